"""The prefix experiment's traces: chat-shaped traffic for adapter-aware prefix caching, and
the same prompt lengths with nothing shared. Pure numpy: builds nothing, runs nothing.

Chat trace: `num_adapters` adapters, each with a system prompt of its own (`system_len`
tokens); conversation c on adapter c % num_adapters with that adapter's system prompt, 1 to
`max_turns` turns (uniform), conversations made until they hold `num_requests` turns (the last
one cut short). Turn k sends the whole history again:

    system prompt + user_1 + output_1 + ... + output_(k-1) + user_k      (user_k: 32-64 tokens)

and asks for `max_tokens` tokens, EOS ignored. Conversations start at Poisson arrivals
(`rate` per second, seeded); a conversation's next turn is sent when its previous turn
finished, so its prompt holds what the system itself answered (bench/systems/chat_loop.py
drives it; with greedy decoding every run of one model gets the same answers).

Unshared trace: one-turn conversations, no system prompt, each a fresh random prompt exactly
as long as one turn of the chat trace (the same lengths, shuffled): what hashing and lookup
cost when no prefix is ever shared.

A trace travels as a Workload's JSON (one request per turn: the turn's new user tokens, its
conversation's start as arrival time, its adapter, max_tokens), so a worker counts its tokens
like any workload's, plus a "chat" key: the system prompts and each conversation's system
prompt and requests in turn order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ort_lora.bench.workloads import BenchRequest, Workload, random_prompt


@dataclass(frozen=True)
class Conversation:
    """One conversation: its adapter (None: base), the index of its system prompt (None:
    none), when its first turn is sent, and each turn's new user tokens."""

    adapter: int | None
    system: int | None
    arrival_s: float
    turns: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class ChatTrace:
    """Conversations over shared system prompts; every turn asks for max_tokens tokens."""

    name: str
    system_prompts: tuple[tuple[int, ...], ...]
    conversations: tuple[Conversation, ...]
    max_tokens: int
    num_adapters: int

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    @property
    def output_tokens(self) -> int:
        return self.num_requests * self.max_tokens

    def prompt_lengths(self) -> list[int]:
        """The prompt length of every turn, in request order (outputs are max_tokens long)."""
        out = []
        for c in self.conversations:
            length = 0 if c.system is None else len(self.system_prompts[c.system])
            for k, user in enumerate(c.turns):
                length += len(user) + (self.max_tokens if k else 0)
                out.append(length)
        return out

    def to_workload(self) -> Workload:
        """One request per turn (its new user tokens, arriving at its conversation's start)."""
        reqs = tuple(
            BenchRequest(user, self.max_tokens, c.adapter, c.arrival_s)
            for c in self.conversations
            for user in c.turns
        )
        return Workload(self.name, reqs, self.num_adapters)

    def to_json(self) -> dict:
        conversations, i = [], 0
        for c in self.conversations:
            conversations.append({"system": c.system, "requests": list(range(i, i + len(c.turns)))})
            i += len(c.turns)
        chat = {"system_prompts": [list(p) for p in self.system_prompts]}
        return {**self.to_workload().to_json(), "chat": {**chat, "conversations": conversations}}

    @staticmethod
    def from_json(d: dict) -> ChatTrace:
        reqs, chat = d["requests"], d["chat"]
        convs = []
        for c in chat["conversations"]:
            first = reqs[c["requests"][0]]
            turns = tuple(tuple(reqs[i]["prompt_ids"]) for i in c["requests"])
            convs.append(Conversation(first["adapter"], c["system"], first["arrival_s"], turns))
        prompts = tuple(tuple(p) for p in chat["system_prompts"])
        max_tokens = reqs[0]["max_tokens"] if reqs else 0
        return ChatTrace(d["name"], prompts, tuple(convs), max_tokens, d["num_adapters"])


def first_conversations(trace: ChatTrace, n: int) -> ChatTrace:
    """The trace's first n conversations (by arrival): the same traffic, stopped sooner."""
    if not 1 <= n <= len(trace.conversations):
        raise ValueError(f"n must be in [1, {len(trace.conversations)}], got {n}")
    convs = sorted(trace.conversations, key=lambda c: c.arrival_s)[:n]
    name = f"{trace.name}-first{n}"
    return ChatTrace(name, trace.system_prompts, tuple(convs), trace.max_tokens, trace.num_adapters)


def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """n arrival times (s) of a Poisson process at `rate` per second, the first at 0."""
    if rate <= 0:
        raise ValueError(f"arrival rate must be > 0, got {rate}")
    gaps = rng.exponential(1.0 / rate, size=n)
    return np.cumsum(gaps) - gaps[0]


def turn_counts(rng: np.random.Generator, num_requests: int, max_turns: int) -> list[int]:
    """Turns per conversation, uniform in [1, max_turns], summing to num_requests."""
    if num_requests < 1 or max_turns < 1:
        raise ValueError(
            f"num_requests and max_turns must be >= 1, got {num_requests}, {max_turns}"
        )
    counts = []
    while sum(counts) < num_requests:
        counts.append(int(rng.integers(1, max_turns + 1)))
    counts[-1] -= sum(counts) - num_requests
    return counts


def chat_trace(
    num_requests: int,
    num_adapters: int,
    system_len: int,
    user_range: tuple[int, int],
    max_turns: int,
    max_tokens: int,
    rate: float,
    vocab_size: int,
    seed: int = 0,
) -> ChatTrace:
    """The chat trace (module docstring); user turn lengths uniform in the inclusive range."""
    if num_adapters < 1:
        raise ValueError(f"num_adapters must be >= 1, got {num_adapters}")
    rng = np.random.default_rng(seed)
    prompts = tuple(random_prompt(rng, system_len, vocab_size) for _ in range(num_adapters))
    counts = turn_counts(rng, num_requests, max_turns)
    arrivals = poisson_arrivals(rng, len(counts), rate)
    convs = []
    for c, (count, start) in enumerate(zip(counts, arrivals)):
        lengths = rng.integers(user_range[0], user_range[1] + 1, size=count)
        turns = tuple(random_prompt(rng, int(n), vocab_size) for n in lengths)
        convs.append(Conversation(c % num_adapters, c % num_adapters, float(start), turns))
    name = f"chat-{num_adapters}x{system_len}"
    return ChatTrace(name, prompts, tuple(convs), max_tokens, num_adapters)


def unshared_trace(
    chat: ChatTrace, num_requests: int, rate: float, vocab_size: int, seed: int = 0
) -> ChatTrace:
    """`num_requests` one-turn conversations, fresh random prompts as long as turns of the
    chat trace (its lengths shuffled, the first num_requests), on adapter i % num_adapters,
    Poisson arrivals at `rate`."""
    if not 1 <= num_requests <= chat.num_requests:
        raise ValueError(f"num_requests must be in [1, {chat.num_requests}], got {num_requests}")
    rng = np.random.default_rng(seed + 1)
    lengths = rng.permutation(chat.prompt_lengths())[:num_requests]
    arrivals = poisson_arrivals(rng, len(lengths), rate)
    convs = tuple(
        Conversation(
            i % chat.num_adapters, None, float(t), (random_prompt(rng, int(n), vocab_size),)
        )
        for i, (n, t) in enumerate(zip(lengths, arrivals))
    )
    return ChatTrace(f"unshared-{len(convs)}", (), convs, chat.max_tokens, chat.num_adapters)
