"""HostCache: converted adapters kept in host memory, least recently used first, at most
max_entries of them (0: none kept; every get reads the files again). Keyed by int adapter id;
what a miss does is the `load` function given (the registry's: read the files, check they are
still the registered adapter)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from ort_lora.adapters.host import HostAdapter


class HostCache:
    def __init__(self, max_entries: int, load: Callable[[int], HostAdapter]):
        self.max_entries = max_entries
        self._load = load
        self._adapters: OrderedDict[int, HostAdapter] = OrderedDict()
        self.stats = {"host_hits": 0, "host_misses": 0, "host_evictions": 0}

    def get(self, aid: int) -> HostAdapter:
        """The adapter from the cache (now most recently used), or loaded and cached."""
        if aid in self._adapters:
            self.stats["host_hits"] += 1
            self._adapters.move_to_end(aid)
            return self._adapters[aid]
        self.stats["host_misses"] += 1
        adapter = self._load(aid)
        self.put(aid, adapter)
        return adapter

    def put(self, aid: int, adapter: HostAdapter) -> None:
        """Cache the adapter as most recently used, evicting the least recent over the bound."""
        self._adapters[aid] = adapter
        self._adapters.move_to_end(aid)
        while len(self._adapters) > self.max_entries:
            self._adapters.popitem(last=False)
            self.stats["host_evictions"] += 1

    def drop(self, aid: int) -> None:
        self._adapters.pop(aid, None)

    def ids(self) -> list[int]:
        """Ids of the cached adapters, least recently used first."""
        return list(self._adapters)
