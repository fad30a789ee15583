"""Sequence: one completion's tokens, KV blocks and lifecycle, as the scheduler sees it.

A request with n completions is n sequences; each is named by its completion id
("<request_id>#<index>", see engine/request.py), never by the user's request id.

Token bookkeeping: `token_ids` = prompt + output. `num_computed_tokens` of them have their
K/V in the pool; the next step runs `token_ids[num_computed_tokens:]` (or a chunk of it).
In decode exactly one token is pending: the last sampled one. Preemption by recompute resets
`num_computed_tokens` to 0 and keeps the output, so prompt + output is prefilled again.

Lifecycle (changed only by `Sequence.set_status`):

    WAITING ──admit──▶ RUNNING ──finish──▶ FINISHED_STOPPED | FINISHED_LENGTH
       ▲                  │
       └────preempt───────┘       any unfinished state ──abort──▶ FINISHED_ABORTED
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Hashable
from collections.abc import Sequence as SeqOf
from typing import Any


class SequenceStatus(enum.Enum):
    """The lifecycle state, with its OpenAI-style finish_reason ("stop", "length", "abort";
    None while unfinished) as a plain attribute: read for every completion at every step."""

    WAITING = 1, None  # queued, holds no pages and no adapter pin (new or preempted)
    RUNNING = 2, None  # holds KV pages for all its tokens and a pin on its adapter
    FINISHED_STOPPED = 3, "stop"  # sampled an EOS / stop token or produced a stop string
    FINISHED_LENGTH = 4, "length"  # reached max_tokens or max_model_len
    FINISHED_ABORTED = 5, "abort"  # cancelled by the caller (client gone, abort()) or failed

    def __init__(self, _: int, finish_reason: str | None):
        self.finish_reason = finish_reason
        self.is_finished = finish_reason is not None


_FINISHED = {s for s in SequenceStatus if s.is_finished}
_TRANSITIONS = {
    SequenceStatus.WAITING: {SequenceStatus.RUNNING, SequenceStatus.FINISHED_ABORTED},
    SequenceStatus.RUNNING: {SequenceStatus.WAITING} | _FINISHED,
}


class Sequence:
    """One completion. Build it in the engine; the scheduler owns it after `Scheduler.add`.
    The engine validates requests (engine/request.py: check_request) before building them.

    completion_id:         unique id (str) of the completion
    prompt_token_ids:      non-empty list of token ids
    max_tokens:            output tokens at most (the sampling params' max_tokens)
    adapter_id:            hashable adapter id, None = base model (or a composition)
    adapter_pages:         pool pages the adapter occupies (from the adapter registry)
    sampling_params:       opaque to the scheduler; carried for the engine and sampler
    wants_prompt_logprobs: return logits of every prompt row (for prompt_logprobs)
    composition:           ((adapter id, pages, weight), ...) of a composed request (its rows
                           get sum_i w_i * adapter_i); adapter_id is None then. Every composed
                           adapter is pinned while it runs and counts against max_loras.
    cache_salt:            what, beside the tokens, its KV depends on (the adapter content:
                           engine/prefix_cache.py); None: it takes no part in prefix caching
    """

    def __init__(
        self,
        completion_id: str,
        prompt_token_ids: SeqOf[int],
        max_tokens: int,
        adapter_id: Hashable | None = None,
        adapter_pages: int = 0,
        sampling_params: Any = None,
        wants_prompt_logprobs: bool = False,
        composition: SeqOf[tuple[Hashable, int, float]] = (),
        cache_salt: bytes | None = None,
    ):
        self.completion_id = completion_id
        self.prompt_token_ids = [operator.index(t) for t in prompt_token_ids]
        self.output_token_ids: list[int] = []
        self.max_tokens = max_tokens
        self.adapter_id = adapter_id
        self.adapter_pages = adapter_pages
        self.sampling_params = sampling_params
        self.wants_prompt_logprobs = wants_prompt_logprobs
        self.composition = tuple((aid, pages, float(w)) for aid, pages, w in composition)
        self.arrival = -1  # set by Scheduler.add: admission and preemption order
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.num_preemptions = 0
        # Prompt rows whose logits were already returned (not repeated after a preemption).
        self.num_prompt_logits_done = 0
        # What ended it when status is FINISHED_STOPPED: the stop token id or stop string,
        # None for an EOS token (vLLM's stop_reason). The finish reason is the status itself.
        self.stop_reason: int | str | None = None
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []  # of its first full blocks (prefix_cache.py)
        self.num_cached_blocks = 0  # leading blocks of block_table that are in the cache
        self.num_cached_tokens = 0  # prompt tokens found in the cache at its first admission
        assert self.prompt_token_ids and self.max_tokens >= 1, f"unchecked request: {self}"
        assert adapter_id is None or adapter_pages >= 1, f"adapter without pages: {self}"
        assert adapter_id is None or not composition, f"an adapter and a composition: {self}"
        assert all(pages >= 1 for _, pages, _ in self.composition), f"adapter without pages: {self}"

    # ---- adapters ---------------------------------------------------------------------------

    @property
    def adapters(self) -> tuple[tuple[Hashable, int], ...]:
        """(adapter id, pages) of every adapter it runs with: none, its one, or the composed."""
        if self.composition:
            return tuple((aid, pages) for aid, pages, _ in self.composition)
        return () if self.adapter_id is None else ((self.adapter_id, self.adapter_pages),)

    @property
    def adapter_ids(self) -> tuple[Hashable, ...]:
        return tuple(aid for aid, _ in self.adapters)

    # ---- derived sizes ----------------------------------------------------------------------

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens not yet in the KV cache (1 in decode)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def blocks_needed(self, block_size: int) -> int:
        """Blocks to add so that every token (prompt + output) has a KV slot."""
        return -(-self.num_tokens // block_size) - len(self.block_table)

    # ---- mutation ---------------------------------------------------------------------------

    def set_status(self, status: SequenceStatus) -> None:
        """The one place the lifecycle changes; rejects transitions the diagram forbids."""
        if status not in _TRANSITIONS.get(self.status, ()):
            raise ValueError(
                f"{self.completion_id}: illegal status change {self.status.name} -> {status.name}"
            )
        if status is SequenceStatus.WAITING:
            self.num_preemptions += 1
        self.status = status

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(int(token_id))

    def __repr__(self) -> str:
        return (
            f"Sequence({self.completion_id!r}, {self.status.name}, "
            f"adapter={self.composition or self.adapter_id!r}, "
            f"tokens={self.num_prompt_tokens}+{len(self.output_token_ids)}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
