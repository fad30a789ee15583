"""ReplicaAdapters: which adapters one Ray Serve replica's engine holds, and why. Pure
bookkeeping: no Ray, no engine.

Ray Serve's `@serve.multiplexed` keeps an LRU of at most K adapters per replica and says when
one is evicted; the replica registers an adapter in its engine when it is loaded and
unregisters it when it is evicted. Eviction is LRU by *arrival*, so Ray may evict an adapter
that requests on this replica still stream with: it is then unregistered when the last of
them ends, unless a new request wants it back first. The cluster registry (ray/directory.py)
can take an adapter away too (an unload); it leaves the same way.

An adapter is a LoRARequest (name, int id, path). A name unloaded and loaded again comes back
with a new int id: the old registration goes first (at once if idle; else the new request is
refused with a retryable error, AdapterBusy).

Per adapter it counts requests that found it registered (hits), requests that did not
(misses), registrations (loads) and unregistrations (evictions): the affinity figures.
"""

from __future__ import annotations

from collections import Counter

from ort_lora.lora_request import LoRARequest

COUNTERS = ("hits", "misses", "loads", "evictions")


class AdapterBusy(RuntimeError):
    """The name is registered here with another int id and requests still use that one."""


class ReplicaAdapters:
    def __init__(self):
        self.registered: dict[str, LoRARequest] = {}
        self._users: Counter[LoRARequest] = Counter()  # requests on this replica using it
        self._leaving: set[str] = set()  # evicted or unloaded: unregister once idle
        self.counters: dict[str, dict[str, int]] = {}

    def arrive(self, lora: LoRARequest) -> bool:
        """A request for `lora` starts here: one more user; True if it was registered."""
        hit = self.registered.get(lora.lora_name) == lora
        self._count(lora.lora_name, "hits" if hit else "misses")
        self._users[lora] += 1
        if hit:
            self._leaving.discard(lora.lora_name)  # wanted again before it left
        return hit

    def to_register(self, lora: LoRARequest) -> tuple[bool, LoRARequest | None]:
        """Before registering `lora`: (whether it must be registered, the registration of
        the same name to remove first). AdapterBusy if that one is still in use."""
        old = self.registered.get(lora.lora_name)
        if old == lora:
            self._leaving.discard(lora.lora_name)
            return False, None
        if old is not None and self._users[old]:
            raise AdapterBusy(
                f"adapter {lora.lora_name!r} was loaded again (lora_int_id {old.lora_int_id} -> "
                f"{lora.lora_int_id}) and requests on this replica still use the old one; retry"
            )
        return True, old

    def did_register(self, lora: LoRARequest) -> None:
        self.registered[lora.lora_name] = lora
        self._leaving.discard(lora.lora_name)
        self._count(lora.lora_name, "loads")

    def did_unregister(self, name: str) -> None:
        if self.registered.pop(name, None) is not None:
            self._count(name, "evictions")
        self._leaving.discard(name)

    def release(self, lora: LoRARequest) -> bool:
        """A request for `lora` ended; True if the adapter should be unregistered now."""
        self._users[lora] -= 1
        if self._users[lora] <= 0:
            del self._users[lora]
        return self.leaving_and_idle(lora.lora_name)

    def evict(self, name: str) -> bool:
        """Ray evicted it (or the registry dropped it); True if it should be unregistered now
        (idle), else it leaves when its last request ends."""
        if name not in self.registered:
            return False
        self._leaving.add(name)
        return self.leaving_and_idle(name)

    def drop_unknown(self, served: dict[str, int]) -> list[str]:
        """The registry serves `served` (name -> int id): names registered here under
        another id, or no longer served, leave; those to unregister now."""
        gone = [n for n, r in self.registered.items() if served.get(n) != r.lora_int_id]
        return [n for n in gone if self.evict(n)]

    def in_use(self) -> dict[str, int]:
        """name -> requests on this replica using it (adapters in use only)."""
        out: dict[str, int] = {}
        for lora, count in self._users.items():
            out[lora.lora_name] = out.get(lora.lora_name, 0) + count
        return out

    def leaving_and_idle(self, name: str) -> bool:
        """Evicted or dropped, and no request here uses it: unregister it now."""
        lora = self.registered.get(name)
        return name in self._leaving and lora is not None and not self._users[lora]

    def _count(self, name: str, key: str) -> None:
        counters = self.counters.setdefault(name, dict.fromkeys(COUNTERS, 0))
        counters[key] += 1
