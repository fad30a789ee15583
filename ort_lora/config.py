"""EngineConfig: every knob of the serving engine, validated once, passed explicitly.

Pure data: imports neither onnxruntime nor torch. The pool size is given either as a page
count (`num_pages`) or as a memory budget (`pool_memory_bytes`) that `num_pages_for(manifest)`
converts with the model's page size (one page = one KV block of every layer, K and V).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ort_lora.contract import ModelManifest

DEFAULT_POOL_BYTES = 512 << 20
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def page_bytes(manifest: ModelManifest) -> int:
    """Bytes of one pool page: K and V halves of one block in every layer."""
    if manifest.dtype not in DTYPE_BYTES:
        raise ValueError(
            f"model dtype {manifest.dtype!r} is not supported; expected one of {list(DTYPE_BYTES)}"
        )
    return manifest.num_layers * 2 * manifest.page_elems * DTYPE_BYTES[manifest.dtype]


@dataclass
class EngineConfig:
    """Scheduler, pool and adapter-cache limits of one engine.

    max_num_seqs:           sequences in one step (decode and prefill together)
    max_num_batched_tokens: packed tokens in one step (the chunked-prefill budget)
    max_loras:              distinct adapters among running requests (base never counts)
    max_cpu_loras:          adapters kept in host memory (LRU); None = max(4 * max_loras, 16)
    num_pages:              pool size in pages; or give pool_memory_bytes instead
    pool_memory_bytes:      pool size in bytes, converted with the model's page size
                            (neither given: 512 MiB)
    block_size:             tokens per KV block; None = the exported model's (must match it)
    max_model_len:          prompt + output tokens of one request; None = the model's limit
                            (the engine resolves it with model_len(manifest) before building
                            the Scheduler; a Scheduler given None bounds requests by the pool)
    max_adapter_wait_steps: steps a request blocked by the max_loras cap may be passed over
                            by later requests before admission stops for them (fairness)
    prefetch_adapters:      load the adapters of waiting requests into FREE pages ahead of
                            their admission (S-LoRA prefetch: on a GPU the copy overlaps with
                            the running step); None = on for device cuda, off for cpu (CPU
                            copies are synchronous: there is nothing to overlap)
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_loras: int = 4
    max_cpu_loras: int | None = None
    num_pages: int | None = None
    pool_memory_bytes: int | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    max_adapter_wait_steps: int = 4
    prefetch_adapters: bool | None = None

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_loras"):
            _check_positive(name, getattr(self, name))
        optional = ("num_pages", "pool_memory_bytes", "max_model_len", "max_cpu_loras")
        for name in (*optional, "block_size"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.max_adapter_wait_steps < 0:
            raise ValueError(
                f"max_adapter_wait_steps must be >= 0, got {self.max_adapter_wait_steps}"
            )
        if self.num_pages is not None and self.pool_memory_bytes is not None:
            raise ValueError(
                "give one of num_pages and pool_memory_bytes, not both: got "
                f"num_pages={self.num_pages}, pool_memory_bytes={self.pool_memory_bytes}"
            )
        if self.num_pages is None and self.pool_memory_bytes is None:
            self.pool_memory_bytes = DEFAULT_POOL_BYTES
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode"
            )
        if self.max_cpu_loras is None:
            self.max_cpu_loras = max(4 * self.max_loras, 16)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    def resolved(self, manifest: ModelManifest) -> EngineConfig:
        """A copy for this model with num_pages, block_size and max_model_len filled in
        (what the Scheduler and PagePool are built from)."""
        return replace(
            self,
            num_pages=self.num_pages_for(manifest),
            block_size=manifest.block_size,
            pool_memory_bytes=None,
            max_model_len=self.model_len(manifest),
        )

    def num_pages_for(self, manifest: ModelManifest) -> int:
        """Pool size in pages for this model (checks block_size and max_model_len against it)."""
        self.check_model(manifest)
        if self.num_pages is not None:
            return self.num_pages
        pages = self.pool_memory_bytes // page_bytes(manifest)
        if pages < 1:
            raise ValueError(
                f"pool_memory_bytes={self.pool_memory_bytes} holds no page; one page of this "
                f"model is {page_bytes(manifest)} bytes"
            )
        return pages

    def model_len(self, manifest: ModelManifest) -> int:
        """max_model_len, defaulting to the model's max_position_embeddings."""
        return self.max_model_len or manifest.max_position_embeddings

    def check_model(self, manifest: ModelManifest) -> None:
        """Raise ValueError if this config cannot drive the exported model."""
        if self.block_size is not None and manifest.block_size != self.block_size:
            raise ValueError(
                f"block_size {self.block_size} does not match the exported model's "
                f"block_size {manifest.block_size}"
            )
        limit = manifest.max_position_embeddings
        if self.max_model_len is not None and self.max_model_len > limit:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {limit}"
            )


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
