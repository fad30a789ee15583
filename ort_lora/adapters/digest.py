"""The content digest of an adapter: what names its KV in the prefix cache.

It covers everything of an adapter that changes the model's output, in its host form
(host.py): per target module (in name order) its A and B^T rows, ranks and scales (PEFT's
scaling per layer: lora_alpha / r, or / sqrt(r) with rslora, rank and alpha patterns
applied) and a DoRA adapter's scale rows D (from its magnitudes and the base weights, which
are the engine's). Not in it: the
adapter's name, path, file times, PEFT fields that do not change the output (the base
model's name, task type, the module names as the file spells them), and how its rows are
stored in the pool (the engine's row type, the same for every adapter). So two names with
identical files have one digest, and new weights under an old name have another.
"""

from __future__ import annotations

import hashlib

import numpy as np

from ort_lora.adapters.host import HostAdapter


def adapter_digest(adapter: HostAdapter) -> bytes:
    """BLAKE2b-128 over the adapter's output-changing content (see the module docstring)."""
    h = hashlib.blake2b(digest_size=16, person=b"ort-lora-lora")
    for name in sorted(adapter.modules):
        w = adapter.modules[name]
        h.update(name.encode() + b"\0")
        for part in (w.a, w.bt, w.ranks, w.scales, w.dora, w.magnitude):
            if part is None:
                h.update(b"-")
                continue
            part = np.ascontiguousarray(part)
            h.update(f"{part.dtype.str}{part.shape}".encode())
            h.update(memoryview(part).cast("B"))
    return h.digest()
