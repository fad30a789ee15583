"""Structured outputs: a grammar per completion, and the token masks that enforce it.

The grammar engine is llguidance (PyPI): JSON Schema, regex, choice and Lark grammars, a
numpy bitmask API, no torch (xgrammar, the other well-kept engine, imports torch, which the
serving path must not). `Grammars` compiles a request's StructuredOutputs once (cached by
spec, as a matcher in its start state) and makes one `Constraint` (a copy of that matcher)
per completion. Each step:

    masks = grammars.start_masks({completion id: constraint})  # on llguidance's threads ...
    logits = runner.run(plan)                   # ... while ORT runs the graph
    masks.apply(ids, sample_rows)               # row.allowed: bool [V]
    token = sample(logits, rows)                # the sampler forbids what the grammar does
    constraint.advance(token)                   # True once the grammar is complete: stop

The vocabulary of the masks is the model's output layer (manifest.vocab_size): ids the
tokenizer lacks (padding rows) are never allowed.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from ort_lora.errors import RequestError
from ort_lora.sampling_params import StructuredOutputs

MAX_CACHED_GRAMMARS = 256


class Constraint:
    """One completion's grammar state (an llguidance LLMatcher)."""

    def __init__(self, matcher):
        self.matcher = matcher

    def advance(self, token: int) -> bool:
        """Consume the sampled token; True when the grammar is complete (stop the output).
        A token the mask forbade (it cannot happen) leaves the matcher in an error state:
        RequestError for this request only."""
        if not self.matcher.consume_token(int(token)):
            raise RequestError(f"the output left its grammar: {self.matcher.get_error()}")
        return self.matcher.is_stopped()


class Masks:
    """Next-token bitmasks being filled on llguidance's threads for some completions;
    apply() joins them and sets each constrained sample row's `allowed`."""

    def __init__(self, rows: dict[str, int], bits: np.ndarray, vocab: int):
        self.rows, self.bits, self.vocab = rows, bits, vocab  # completion id -> mask row
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def apply(self, completion_ids: Sequence[str], sample_rows: Sequence) -> None:
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error
        flat = np.unpackbits(self.bits.view(np.uint8), axis=1, bitorder="little")  # [B, 32 W]
        allowed = flat[:, : self.vocab].astype(bool)  # [B, V]
        for cid, row in zip(completion_ids, sample_rows):
            if cid in self.rows:
                row.allowed = allowed[self.rows[cid]]


class Grammars:
    """Compiles StructuredOutputs for one model's tokenizer; makes constraints and masks.
    llguidance's tokenizer (about a second to build) is made on first use."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids):
        self._tokenizer_json = tokenizer_json
        self.vocab = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer = self._executor = None
        self._cache: OrderedDict[str, object] = OrderedDict()  # spec -> LLMatcher
        self._lock = threading.Lock()  # compile() also runs on servers' worker threads

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = _llg().LLTokenizer(
                    self._tokenizer_json(), n_vocab=self.vocab, eos_token=self.eos_token_ids
                )
                self._executor = _llg().LLExecutor()
        return self._tokenizer

    def constraints_for(
        self, spec: StructuredOutputs | None, compiled=None
    ) -> Callable[[], Constraint] | None:
        """A maker of constraints for a request's structured output (compiled and checked
        now: RequestError if it cannot be enforced), None without one. compiled: what
        compile(spec) returned (a server compiles on a worker thread first, AsyncEngine: the
        engine's thread then compiles nothing)."""
        if spec is None:
            return None
        prototype = compiled if compiled is not None else self.compile(spec)
        return lambda: Constraint(prototype.deep_copy())

    def compile(self, spec: StructuredOutputs):
        """A fresh matcher of `spec`'s grammar, which constraints copy (compiled once per
        spec, cached); RequestError naming the request field it came from (spec.source) if
        the schema, regex or grammar is invalid or cannot be enforced."""
        param = spec.source
        key = json.dumps([spec.json, spec.regex, spec.choice, spec.grammar, spec.json_object,
                          spec.strict], sort_keys=True, default=str)  # fmt: skip
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        prototype = _llg().LLMatcher(self.tokenizer, _grammar(spec, param), log_level=0)
        if prototype.is_error():
            raise RequestError(f"{param}: {prototype.get_error()[:500]}", param)
        with self._lock:
            self._cache[key] = prototype
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return prototype

    def start_masks(self, constraints: dict[str, Constraint]) -> Masks | None:
        """Begin filling the next-token masks of these completions' constraints on
        llguidance's threads, which release the GIL: the caller runs the model meanwhile."""
        if not constraints:
            return None
        bits = np.full((len(constraints), (self.vocab + 31) // 32), -1, np.int32)
        masks = Masks(dict(zip(constraints, range(len(constraints)))), bits, self.vocab)
        pairs = [(c.matcher, i) for i, c in enumerate(constraints.values())]

        def fill():
            try:
                self._executor.unsafe_compute_mask_ptr(
                    pairs, bits.ctypes.data, bits.shape[1] * 4, len(pairs)
                )
            except BaseException as exc:  # surfaced by apply(), on the engine's thread
                masks.error = exc

        masks.thread = threading.Thread(target=fill, name="ort-lora-grammar", daemon=True)
        masks.thread.start()
        return masks


def _llg():
    import llguidance

    return llguidance


def _grammar(spec: StructuredOutputs, param: str) -> str:
    matcher = _llg().LLMatcher
    if spec.regex is not None:
        return matcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return matcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, spec.choice)))
    if spec.grammar is not None:
        return matcher.grammar_from_lark(spec.grammar)
    schema = {"type": "object"} if spec.json_object else _closed(spec.json, param)
    # One layout, json.dumps' (xgrammar's without free whitespace): `{"a": 1, "b": 2}`, what
    # models (and the demo json adapter) write; llguidance's compact default `{"a":1}` pushes
    # them off it. No free whitespace: nothing loops to max_tokens, nothing follows the "}".
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
               "lenient": not spec.strict}  # fmt: skip
    try:
        return matcher.grammar_from_json_schema(schema, overrides=options)
    except ValueError as exc:
        message = f"{param}: the JSON schema is not a JSON object ({exc})"
        raise RequestError(message, param) from exc


_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMAS = ("additionalProperties", "items", "not", "if", "then", "else", "contains",
            "propertyNames", "unevaluatedItems", "unevaluatedProperties")  # fmt: skip


def _closed(schema, param: str):
    """A copy of `schema` in which an object that lists its properties and says nothing of
    others admits only those (as vLLM's default grammar engine, xgrammar's strict mode, does):
    free extra properties let a small model write on past max_tokens."""
    if not isinstance(schema, dict):
        return schema
    try:
        schema = json.loads(json.dumps(schema))
    except RecursionError as exc:
        raise RequestError(f"{param}: the JSON schema is nested too deeply", param) from exc
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue  # true / false schemas
        if isinstance(node.get("properties"), dict) and not any(k in node for k in _OPEN_KEYS):
            node["additionalProperties"] = False
        for key in _SCHEMA_MAPS:
            if isinstance(node.get(key), dict):
                stack += node[key].values()
        for key in _SCHEMA_LISTS:
            if isinstance(node.get(key), list):
                stack += node[key]
        stack += [node[key] for key in _SCHEMAS if isinstance(node.get(key), dict)]
    return schema
