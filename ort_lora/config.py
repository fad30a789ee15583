"""EngineConfig: every knob of the serving engine, validated once, passed explicitly.

Pure data: imports neither onnxruntime nor torch. The pool size is given as a page count
(`num_pages`), a memory budget (`pool_memory_bytes`) or a fraction of the host memory left for
it (`pool_memory_fraction`, the default: vLLM's gpu_memory_utilization applied to host memory);
`num_pages_for(manifest)` converts with the model's page size (one page = one KV block of every
layer, K and V).

Default pool (CPU): pool_memory_fraction (0.10) of the memory the machine has available when
the engine starts, less the model's weights (they are loaded after), clamped to
[256 MiB, 4 GiB]. A CUDA pool lives in device memory: 512 MiB unless given.
Default max_loras: the pool alone bounds the distinct adapters in a step (S-LoRA's unified
paging): a request is admitted when KV blocks for all its tokens and its adapter's pages fit
beside the running sequences' (idle adapters are evicted), so as many distinct adapters run as
fit. max_loras, when given, is an upper bound on top of that.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ort_lora.contract import ModelManifest

DEFAULT_POOL_BYTES = 512 << 20  # device pools (CUDA)
DEFAULT_POOL_FRACTION = 0.10
POOL_FLOOR_BYTES = 256 << 20
POOL_CAP_BYTES = 4 << 30
# Host adapter cache by default: on CPU the pool itself is host memory and holds every resident
# adapter (registration preloads them into free pages; a step's inputs need no host copy), so a
# host copy would only spare a disk read for an adapter the pool evicted: none are kept.
# A device pool keeps S-LoRA's host tier: max(4 * max_loras, 16), or 32 without max_loras.
CPU_HOST_LORAS = 0
DEVICE_HOST_LORAS = 32
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def page_bytes(manifest: ModelManifest) -> int:
    """Bytes of one pool page: K and V halves of one block in every layer."""
    if manifest.dtype not in DTYPE_BYTES:
        raise ValueError(
            f"model dtype {manifest.dtype!r} is not supported; expected one of {list(DTYPE_BYTES)}"
        )
    return manifest.num_layers * 2 * manifest.page_elems * DTYPE_BYTES[manifest.dtype]


def weight_bytes(manifest: ModelManifest) -> int:
    """Bytes of the model's weights (projections, MLP, embedding and LM head counted apart)."""
    m = manifest
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    per_layer = m.hidden_size * (2 * q + 2 * kv) + 3 * m.hidden_size * m.intermediate_size
    elems = m.num_layers * per_layer + 2 * m.vocab_size * m.hidden_size
    return elems * DTYPE_BYTES.get(m.dtype, 4)


def available_host_bytes() -> int:
    """Memory the machine can still give without swapping (MemAvailable; physical free
    pages where /proc/meminfo is missing)."""
    import os

    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_pool_bytes(manifest: ModelManifest, fraction: float, available: int) -> int:
    """The pool budget for `fraction` of `available` host bytes once the weights are loaded,
    within [POOL_FLOOR_BYTES, POOL_CAP_BYTES]."""
    if manifest.device == "cuda":
        return DEFAULT_POOL_BYTES
    budget = int(fraction * max(0, available - weight_bytes(manifest)))
    return min(max(budget, POOL_FLOOR_BYTES), POOL_CAP_BYTES)


@dataclass
class EngineConfig:
    """Scheduler, pool and adapter-cache limits of one engine.

    max_num_seqs:           sequences in one step (decode and prefill together)
    max_num_batched_tokens: packed tokens in one step (the chunked-prefill budget)
    max_loras:              cap on distinct adapters among running requests (base never
                            counts); None = no cap beyond the pool (resolved to num_pages)
    max_cpu_loras:          adapters kept in host memory (LRU), 0 = none; None = 0 for a CPU
                            pool (the pool is host memory and holds the resident ones),
                            max(4 * max_loras, 16) or 32 for a device pool (resolved with the
                            model)
    num_pages:              pool size in pages; or give pool_memory_bytes or
                            pool_memory_fraction instead
    pool_memory_bytes:      pool size in bytes, converted with the model's page size
    pool_memory_fraction:   pool size as this fraction of the host memory available at start,
                            less the weights, within [256 MiB, 4 GiB] (none of the three given:
                            0.10; CUDA pools: 512 MiB)
    block_size:             tokens per KV block; None = the exported model's (must match it)
    max_model_len:          prompt + output tokens of one request; None = the model's limit
                            (the engine resolves it with model_len(manifest) before building
                            the Scheduler; a Scheduler given None bounds requests by the pool)
    max_adapter_wait_steps: steps a request blocked by the max_loras cap may be passed over
                            by later requests before admission stops for them (fairness)
    prefetch_adapters:      load the adapters of waiting requests into free pages (or idle
                            cached KV blocks') ahead of their admission (S-LoRA prefetch: on
                            a GPU the copy overlaps with the running step); None = on for
                            device cuda, off for cpu (CPU copies are synchronous: there is
                            nothing to overlap)
    preload_adapters:       add_lora copies the adapter into free pool pages (or idle cached
                            KV blocks') at once (idle there, evicted like any idle adapter
                            when KV blocks need pages; no adapter is evicted for it), so its
                            first request finds it resident instead of reading it from disk
                            inside a step
    enable_prefix_caching:  reuse the KV blocks of a prompt prefix already computed under the
                            same adapter content (docs/PREFIX_CACHING.md); vLLM's name
    base_graph:             run the steps in which no row has an adapter on a second graph
                            without LoraSGMV nodes, over the same weights and pool (CPU; the
                            same logits, ~9 % faster one request at a time on an int4 export);
                            None = where the weights are read in place, so that the second
                            graph holds no copy of them (int4 QuantMatMul exports)
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    num_pages: int | None = None
    pool_memory_bytes: int | None = None
    pool_memory_fraction: float | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    max_adapter_wait_steps: int = 4
    prefetch_adapters: bool | None = None
    preload_adapters: bool = True
    enable_prefix_caching: bool = True
    base_graph: bool | None = None

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            _check_positive(name, getattr(self, name))
        optional = ("num_pages", "pool_memory_bytes", "max_model_len", "max_loras")
        for name in (*optional, "block_size"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 0):
            raise ValueError(f"max_cpu_loras must be an integer >= 0, got {cpu!r}")
        if self.max_adapter_wait_steps < 0:
            raise ValueError(
                f"max_adapter_wait_steps must be >= 0, got {self.max_adapter_wait_steps}"
            )
        self._check_pool_size()
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running sequence can decode"
            )
        if self.max_loras is None and self.num_pages is not None:
            self.max_loras = self.num_pages  # an adapter takes >= 1 page: the pool bounds it
        no_cap = self.num_pages is not None and self.max_loras >= self.num_pages
        explicit = self.max_loras is not None and self.max_cpu_loras is not None and not no_cap
        if explicit and 0 < self.max_cpu_loras < self.max_loras:
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
            pool_memory_fraction=None,
            max_model_len=self.model_len(manifest),
            max_cpu_loras=(
                self._default_cpu_loras(manifest)
                if self.max_cpu_loras is None
                else self.max_cpu_loras
            ),
        )

    def _default_cpu_loras(self, manifest: ModelManifest) -> int:
        if manifest.device == "cpu":
            return CPU_HOST_LORAS
        return max(4 * self.max_loras, 16) if self.max_loras else DEVICE_HOST_LORAS

    def num_pages_for(self, manifest: ModelManifest) -> int:
        """Pool size in pages for this model (checks block_size and max_model_len against it)."""
        self.check_model(manifest)
        if self.num_pages is not None:
            return self.num_pages
        nbytes = self.pool_memory_bytes
        if nbytes is None:
            available = available_host_bytes()
            nbytes = default_pool_bytes(manifest, self.pool_memory_fraction, available)
        pages = nbytes // page_bytes(manifest)
        if pages < 1:
            raise ValueError(
                f"pool_memory_bytes={nbytes} holds no page; one page of this "
                f"model is {page_bytes(manifest)} bytes"
            )
        return pages

    def _check_pool_size(self) -> None:
        given = {
            k: getattr(self, k)
            for k in ("num_pages", "pool_memory_bytes", "pool_memory_fraction")
            if getattr(self, k) is not None
        }
        if len(given) > 1:
            raise ValueError(
                "give one of num_pages, pool_memory_bytes and pool_memory_fraction, not both: got "
                + ", ".join(f"{k}={v}" for k, v in given.items())
            )
        if not given:
            self.pool_memory_fraction = DEFAULT_POOL_FRACTION
        f = self.pool_memory_fraction
        if f is not None and not (isinstance(f, (int, float)) and 0 < f <= 0.9):
            raise ValueError(f"pool_memory_fraction must be in (0, 0.9], got {f!r}")

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


def fit_context(config: EngineConfig, explicit: bool) -> EngineConfig:
    """A pool must hold one request of max_model_len tokens (vLLM refuses to start
    otherwise): an explicit max_model_len that does not fit is refused here, at start; the
    model's own limit is lowered to what the pool holds."""
    pages = -(-config.max_model_len // config.block_size)
    if pages <= config.num_pages:
        return config
    if explicit:
        raise ValueError(
            f"max_model_len {config.max_model_len} needs {pages} KV pages of "
            f"{config.block_size} tokens; the pool has {config.num_pages}: grow the pool "
            "(num_pages / pool_memory_bytes) or lower max_model_len"
        )
    return replace(config, max_model_len=config.num_pages * config.block_size)
