"""Benchmark workloads: lists of requests, generated from fixed seeds. Pure numpy.

Punica's adapter-popularity patterns (arXiv 2310.18547, section 7), all requests at t = 0:
    distinct   request i on adapter i (as many adapters as requests)
    uniform    request i on adapter i % num_adapters
    skewed     adapter drawn from a Zipf(alpha) popularity over num_adapters (rank 1 = hottest)
    identical  every request on adapter 0
    base       no adapter (the base model)
S-LoRA's synthetic trace (arXiv 2311.03285, section 7.1): Gamma-distributed inter-arrival
times (rate, coefficient of variation), adapter chosen uniformly at random, prompt and output
lengths drawn uniformly from ranges.
Prompts are random token ids from the upper part of the vocabulary (no special tokens), and
every request generates exactly max_tokens tokens (EOS ignored) so systems do the same work.
Structured outputs: each request's output follows a JSON schema of its own
(`json_schema_workload`); it ends when the schema's object is complete or at max_tokens.
Composition: each request runs with k adapters at weight 1/k (`composed_workload`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import numpy as np

PATTERNS = ("distinct", "uniform", "skewed", "identical", "base")


@dataclass(frozen=True)
class BenchRequest:
    """One request: prompt token ids, tokens to generate, adapter index (None = base model)
    and arrival time in seconds from the start of the run."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    adapter: int | None
    arrival_s: float = 0.0
    schema: dict | None = None  # a JSON schema the output must follow
    compose: tuple[int, ...] = ()  # adapters composed with `adapter`, all at weight 1/k


@dataclass(frozen=True)
class Workload:
    """A named list of requests over `num_adapters` adapters (indices 0..num_adapters-1)."""

    name: str
    requests: tuple[BenchRequest, ...]
    num_adapters: int

    @property
    def output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    @property
    def expected_tokens(self) -> int | tuple[int, int]:
        """What a run must produce: every max_tokens, or, where outputs end with their
        grammar, at least one token per request and at most every max_tokens."""
        if any(r.schema is not None for r in self.requests):
            return len(self.requests), self.output_tokens
        return self.output_tokens

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "num_adapters": self.num_adapters,
            "requests": [asdict(r) for r in self.requests],
        }

    @staticmethod
    def from_json(d: dict) -> Workload:
        reqs = tuple(
            BenchRequest(
                tuple(r["prompt_ids"]),
                r["max_tokens"],
                r["adapter"],
                r["arrival_s"],
                r.get("schema"),
                tuple(r.get("compose", ())),
            )
            for r in d["requests"]
        )
        return Workload(d["name"], reqs, d["num_adapters"])


def random_prompt(rng: np.random.Generator, length: int, vocab_size: int) -> tuple[int, ...]:
    """`length` token ids from the upper three quarters of the vocabulary."""
    if length < 1:
        raise ValueError(f"prompt length must be >= 1, got {length}")
    return tuple(int(t) for t in rng.integers(vocab_size // 4, vocab_size, size=length))


def pattern_adapters(
    pattern: str, n: int, num_adapters: int, rng: np.random.Generator, alpha: float = 1.5
) -> list[int | None]:
    """The adapter index of each of `n` requests under a Punica popularity pattern."""
    if pattern not in PATTERNS:
        raise ValueError(f"unknown adapter pattern {pattern!r}; expected one of {PATTERNS}")
    if pattern == "base":
        return [None] * n
    if num_adapters < 1:
        raise ValueError(f"pattern {pattern!r} needs num_adapters >= 1, got {num_adapters}")
    if pattern == "distinct":
        return list(range(n))
    if pattern == "uniform":
        return [i % num_adapters for i in range(n)]
    if pattern == "identical":
        return [0] * n
    weights = 1.0 / np.arange(1, num_adapters + 1) ** alpha  # Zipf popularity
    return [int(a) for a in rng.choice(num_adapters, size=n, p=weights / weights.sum())]


def popularity_workload(
    pattern: str,
    n: int,
    prompt_len: int,
    max_tokens: int,
    vocab_size: int,
    num_adapters: int = 16,
    seed: int = 0,
) -> Workload:
    """`n` requests at t = 0, fixed prompt and output lengths, adapters by `pattern`."""
    rng = np.random.default_rng(seed)
    adapters = pattern_adapters(pattern, n, num_adapters, rng)
    count = {"distinct": n, "base": 0}.get(pattern, num_adapters)
    reqs = tuple(
        BenchRequest(random_prompt(rng, prompt_len, vocab_size), max_tokens, a) for a in adapters
    )
    return Workload(f"{pattern}-{prompt_len}+{max_tokens}", reqs, count)


def slora_trace(
    n: int,
    rate: float,
    cv: float,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    num_adapters: int,
    seed: int = 0,
) -> Workload:
    """S-LoRA's trace: Gamma inter-arrivals with mean 1/rate and coefficient of variation cv
    (shape 1/cv^2), adapter uniform at random, lengths uniform in the inclusive ranges."""
    if rate <= 0 or cv <= 0:
        raise ValueError(f"trace rate and cv must be > 0, got rate={rate}, cv={cv}")
    rng = np.random.default_rng(seed)
    shape = 1.0 / cv**2
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)  # mean 1/rate
    arrivals = np.cumsum(gaps) - gaps[0]
    reqs = []
    for t in arrivals:
        plen = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
        olen = int(rng.integers(output_range[0], output_range[1] + 1))
        adapter = int(rng.integers(0, num_adapters))
        reqs.append(BenchRequest(random_prompt(rng, plen, vocab_size), olen, adapter, float(t)))
    return Workload(f"slora-trace-{num_adapters}", tuple(reqs), num_adapters)


def registered_workload(
    n: int, prompt_len: int, max_tokens: int, vocab_size: int, num_registered: int, seed: int = 0
) -> Workload:
    """`n` requests at t = 0, each on an adapter drawn uniformly from `num_registered`."""
    rng = np.random.default_rng(seed)
    reqs = tuple(
        BenchRequest(
            random_prompt(rng, prompt_len, vocab_size),
            max_tokens,
            int(rng.integers(0, num_registered)),
        )
        for _ in range(n)
    )
    return Workload(f"registered-{num_registered}", reqs, num_registered)


def request_schema(i: int) -> dict:
    """Request i's own JSON schema: five required fields whose names carry i (so every
    request compiles a grammar of its own), strings and arrays bounded. Its keys and
    punctuation are forced tokens, so an output is at least about 40 tokens long."""
    return {
        "type": "object",
        "properties": {
            f"title_{i}": {"type": "string", "maxLength": 12},
            f"count_{i}": {"type": "integer", "minimum": 0, "maximum": 999},
            f"tags_{i}": {"type": "array", "items": {"enum": [f"a{i}", f"b{i}", f"c{i}"]},
                          "minItems": 2, "maxItems": 4},
            f"flag_{i}": {"type": "boolean"},
            f"note_{i}": {"type": "string", "maxLength": 16},
        },
        "required": [f"title_{i}", f"count_{i}", f"tags_{i}", f"flag_{i}", f"note_{i}"],
        "additionalProperties": False,
    }  # fmt: skip


def json_schema_workload(
    n: int, prompt_len: int, max_tokens: int, vocab_size: int, num_adapters: int, seed: int = 0
) -> Workload:
    """The uniform pattern's requests, request i's output constrained by request_schema(i)."""
    w = popularity_workload("uniform", n, prompt_len, max_tokens, vocab_size, num_adapters, seed)
    reqs = tuple(replace(r, schema=request_schema(i)) for i, r in enumerate(w.requests))
    return Workload(f"json-schema-{prompt_len}+{max_tokens}", reqs, w.num_adapters)


def composed_workload(
    n: int,
    prompt_len: int,
    max_tokens: int,
    vocab_size: int,
    num_adapters: int,
    k: int,
    seed: int = 0,
) -> Workload:
    """The uniform pattern's requests, request i composing adapters i, i + 1, ..., i + k - 1
    (mod num_adapters) at weight 1/k each: the same adapters in use as the uniform pattern."""
    if not 1 <= k <= num_adapters:
        raise ValueError(f"k must be in [1, num_adapters = {num_adapters}], got {k}")
    w = popularity_workload("uniform", n, prompt_len, max_tokens, vocab_size, num_adapters, seed)
    reqs = tuple(
        replace(r, compose=tuple((r.adapter + j) % num_adapters for j in range(1, k)))
        for r in w.requests
    )
    return Workload(f"composed{k}-{prompt_len}+{max_tokens}", reqs, w.num_adapters)
