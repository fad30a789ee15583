"""Which adapter uploads into the CUDA device pool are in flight (cuda_pool.py), which of
their events a step waits for, and which pinned staging buffers are free. Pure bookkeeping:
no CUDA here (events and buffers are opaque), unit-tested on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Staging:
    """A pinned host buffer (address, capacity in bytes) reused across loads."""

    ptr: int
    capacity: int


@dataclass
class Load:
    """An adapter upload in flight: its event fires when the copy has landed."""

    adapter_id: object  # int id or name, as the scheduler names it
    pages: tuple[int, ...]
    event: object
    staging: Staging
    prefetch: bool = False  # for a waiting request: the step it was issued with does not use it
    step: int = 0  # the step it was issued with (PrefetchTracker.step when it began)


@dataclass
class PrefetchTracker:
    """Which uploads are in flight, which events a step waits for, which staging is free.

    No CUDA here: events and staging buffers are opaque; `retire` asks a callback whether an
    event has fired. A staging buffer returns to the free list only when its copy has landed,
    so a new load never overwrites host memory a copy is still reading.
    """

    inflight: list[Load] = field(default_factory=list)
    free: list[Staging] = field(default_factory=list)
    step: int = 0  # steps begun so far (events_for_step calls)

    def acquire(self, nbytes: int) -> Staging | None:
        """The smallest free buffer of at least nbytes (taken off the free list), or None."""
        fits = [s for s in self.free if s.capacity >= nbytes]
        if not fits:
            return None
        best = min(fits, key=lambda s: s.capacity)
        self.free.remove(best)
        return best

    def begin(self, load: Load) -> None:
        """Record a load whose copies and event have been enqueued (for the next step)."""
        load.step = self.step
        self.inflight.append(load)

    def events_for_step(self) -> list[object]:
        """Events the step about to run waits for, then that step counts as begun.

        Every load in flight except the prefetches issued for this step. Those went into
        pages that were free when the step was scheduled (after its KV blocks and adapters
        were placed), so the step neither reads nor writes them. Any other load may share a
        page with the step: one of its adapters, or pages an eviction gave to KV or to
        another adapter since. Waiting on an event that already fired costs nothing.
        """
        events = [ld.event for ld in self.inflight if not (ld.prefetch and ld.step == self.step)]
        self.step += 1
        return events

    def retire(self, is_done: Callable[[object], bool]) -> list[Load]:
        """Drop the loads whose events fired; their staging buffers become free."""
        done = [ld for ld in self.inflight if is_done(ld.event)]
        for ld in done:
            self.inflight.remove(ld)
            self.free.append(ld.staging)
        return done

    def is_loading(self, adapter_id) -> bool:
        return any(ld.adapter_id == adapter_id for ld in self.inflight)
