"""Sequence: one request's tokens, KV blocks and lifecycle, as the scheduler sees it.

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
    WAITING = enum.auto()  # queued, holds no pages and no adapter pin (new or preempted)
    RUNNING = enum.auto()  # holds KV pages for all its tokens and a pin on its adapter
    FINISHED_STOPPED = enum.auto()  # sampled an EOS / stop token or produced a stop string
    FINISHED_LENGTH = enum.auto()  # reached max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()  # cancelled by the caller (client gone, abort())

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style finish_reason: "stop", "length", "abort", or None if unfinished."""
        return _FINISH_REASON.get(self)


_FINISHED = {
    SequenceStatus.FINISHED_STOPPED,
    SequenceStatus.FINISHED_LENGTH,
    SequenceStatus.FINISHED_ABORTED,
}
_FINISH_REASON = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}
_TRANSITIONS = {
    SequenceStatus.WAITING: {SequenceStatus.RUNNING, SequenceStatus.FINISHED_ABORTED},
    SequenceStatus.RUNNING: {SequenceStatus.WAITING} | _FINISHED,
}


class Sequence:
    """One request. Build it in the engine; the scheduler owns it after `Scheduler.add`.

    request_id:            unique id (str) of the request
    prompt_token_ids:      non-empty list of token ids
    max_tokens:            output tokens at most (the sampling params' max_tokens)
    adapter_id:            hashable adapter id, None = base model
    adapter_pages:         pool pages the adapter occupies (from the adapter registry)
    sampling_params:       opaque to the scheduler; carried for the engine and sampler
    wants_prompt_logprobs: return logits of every prompt row (for prompt_logprobs)
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: SeqOf[int],
        max_tokens: int,
        adapter_id: Hashable | None = None,
        adapter_pages: int = 0,
        sampling_params: Any = None,
        wants_prompt_logprobs: bool = False,
    ):
        self.request_id = request_id
        self.prompt_token_ids = _token_list(request_id, prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.max_tokens = max_tokens
        self.adapter_id = adapter_id
        self.adapter_pages = adapter_pages
        self.sampling_params = sampling_params
        self.wants_prompt_logprobs = wants_prompt_logprobs
        self.arrival = -1  # set by Scheduler.add: admission and preemption order
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.num_preemptions = 0
        # Prompt rows whose logits were already returned (not repeated after a preemption).
        self.num_prompt_logits_done = 0
        self._validate()

    def _validate(self) -> None:
        rid = self.request_id
        if not self.prompt_token_ids:
            raise ValueError(f"request {rid}: the prompt is empty; expected at least one token")
        if min(self.prompt_token_ids) < 0:
            raise ValueError(f"request {rid}: prompt token ids must be >= 0")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"request {rid}: max_tokens must be >= 1, got {self.max_tokens!r}")
        if self.adapter_id is not None and self.adapter_pages < 1:
            raise ValueError(
                f"request {rid}: adapter {self.adapter_id!r} needs adapter_pages >= 1, "
                f"got {self.adapter_pages}"
            )

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
                f"request {self.request_id}: illegal status change {self.status.name} -> "
                f"{status.name}"
            )
        if status is SequenceStatus.WAITING:
            self.num_preemptions += 1
        self.status = status

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(int(token_id))

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, adapter={self.adapter_id!r}, "
            f"tokens={self.num_prompt_tokens}+{len(self.output_token_ids)}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )


def _token_list(request_id: str, tokens: SeqOf[int]) -> list[int]:
    try:
        return [operator.index(t) for t in tokens]
    except TypeError as e:
        raise ValueError(f"request {request_id}: prompt token ids must be integers ({e})") from e
