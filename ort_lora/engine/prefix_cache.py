"""Prefix caching: the hash chain that names a KV block, and what a sequence's KV depends on.

A KV block's contents depend on its tokens, on every token before it, and on the weights that
computed them: the base model (fixed for an engine) and the request's adapters. So a full
block is named by a hash chain (vLLM's automatic prefix caching, keyed by adapter content):

    hash(block 0) = H(salt, tokens of block 0)
    hash(block i) = H(hash(block i - 1), tokens of block i)

where the salt names the adapter CONTENT the sequence runs with: `BASE_SALT` for the base
model, H(adapter digest) for one adapter (adapters/digest.py: its weights, ranks, scales and
DoRA rows), and H((digest, weight), ...) in order for a composition. Two names with the same
files share blocks; an adapter reloaded under its old name with new weights never does. H is
BLAKE2b-128: a crafted collision would let one tenant read another's KV, so no fast
non-cryptographic hash.

The pool (engine/pool.py) keeps hash -> page; the scheduler (engine/scheduler.py) looks a new
sequence's prompt up at admission and registers each block once it is full and computed.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Sequence

BASE_SALT = b"base"


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part)
    return h.digest()


def adapter_salt(digest: bytes) -> bytes:
    """The salt of a sequence that runs with one adapter of this content digest."""
    return _h(b"adapter", digest)


def composed_salt(terms: Sequence[tuple[bytes, float]]) -> bytes:
    """The salt of a composed request: its (adapter digest, weight) terms, in order."""
    return _h(b"composed", *(d + struct.pack("<d", w) for d, w in terms))


def extend_hashes(
    hashes: list[bytes], salt: bytes, token_ids: Sequence[int], blocks: int, block_size: int
) -> None:
    """Append to `hashes` (the chain of the first len(hashes) blocks of token_ids) the
    hashes of the blocks up to `blocks` (each of them full in token_ids)."""
    for i in range(len(hashes), blocks):
        parent = hashes[i - 1] if i else salt
        tokens = array("q", token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(_h(parent, tokens.tobytes()))
