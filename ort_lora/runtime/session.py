"""One forward step of an exported model through ONNX Runtime with IOBinding.

The paged pool is ONE numpy array [num_layers, 2 (K|V), num_pages, block_size, kv_heads,
head_dim], allocated once; every key_cache.{l} / value_cache.{l} input is bound once to a view
of it (pool[l, 0] / pool[l, 1], C-contiguous, shared memory: the ops write KV and read adapter
rows in place). Each step binds only the small metadata inputs and fetches the logits.
The inputs come from a StepPlan (engine/model_runner.py); this module knows only the graph.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ort_lora import contract as C
from ort_lora.timing import RUN, StepTimes

POOL_DTYPES = {"float32": np.float32, "float16": np.float16}


def aligned_zeros(shape: tuple[int, ...], dtype, alignment: int = 64) -> np.ndarray:
    """Zeros whose first element is `alignment`-byte aligned (as ORT's allocator would give):
    adapter rows in the pool then start on cache-line boundaries for the SGMV kernel.

    Every page is written here, once: a lazily mapped pool would take its page faults (and
    the kernel's zeroing of transparent huge pages) inside the first steps that load adapters
    or write KV, 10x slower than the copies themselves.
    """
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    raw.fill(0)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes].view(dtype).reshape(shape)


@dataclass
class ModelSession:
    """An exported model loaded in ONNX Runtime (CPU), with its paged pool bound once.

    session.pool: numpy [num_layers, 2, num_pages, block_size, kv_heads, head_dim]; the
    adapter registry writes adapter rows into it (through load_adapter). With device="cuda"
    the pool lives on the GPU (session.cuda_pool) and session.pool is None.
    session.run(inputs) -> logits [N, vocab].
    """

    model_dir: str | Path
    num_pages: int
    intra_op_num_threads: int | None = None
    device: str = "cpu"  # "cpu" (numpy pool) or "cuda" (device pool, runtime/cuda_pool.py)
    timing: StepTimes = field(default_factory=StepTimes, init=False)  # of the last run

    def __post_init__(self):
        import onnxruntime as ort

        import ort_lora

        self.model_dir = Path(self.model_dir)
        self.manifest = C.ModelManifest.load(self.model_dir)
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.manifest.device != self.device:
            raise ValueError(
                f"{self.model_dir} was exported for device {self.manifest.device}; "
                f"this session runs device {self.device} (export again with --device {self.device})"
            )
        if self.num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {self.num_pages}")
        opts = {"intra_op_num_threads": self.intra_op_num_threads}
        opts = {k: v for k, v in opts.items() if v is not None}
        model_path = self.model_dir / C.MODEL_NAME
        self.cuda_pool = None
        if self.device == "cuda":
            from ort_lora.runtime import cuda_pool

            self.cuda_pool = cuda_pool.CudaPool(
                self.manifest, self.num_pages, cuda_pool.CudaRuntime()
            )
            try:  # CudaError with ORT's own cause; CUDA provider first or refused
                self.ort_session = cuda_pool.cuda_session(
                    model_path, ort_lora.session_options(**opts), self.cuda_pool
                )
            except BaseException:
                self.cuda_pool.close()
                raise
        else:
            self.ort_session = ort.InferenceSession(
                str(model_path),
                sess_options=ort_lora.session_options(**opts),
                providers=["CPUExecutionProvider"],
            )
        self._input_names = {i.name for i in self.ort_session.get_inputs()}
        # The read-only arrays bound by the last run, by input name: a decode step's LoRA tables
        # are usually the step before's (the registry's cached arrays, read-only: 38 of 48
        # inputs), and binding them again took 1-2 % of a one-request decode step.
        self._bound: dict[str, np.ndarray] = {}
        self._bind_pool()
        if C.LORA_ROW_TYPES in self._input_names:  # until a run gives them: [0], every slot's
            self._bound[C.LORA_ROW_TYPES] = np.zeros(0, np.int32)  # rows float32
            self._bound[C.LORA_ROW_TYPES].setflags(write=False)
            self.binding.bind_cpu_input(C.LORA_ROW_TYPES, self._bound[C.LORA_ROW_TYPES])

    def _bind_pool(self) -> None:
        import onnxruntime as ort

        m = self.manifest
        if self.cuda_pool is not None:
            from ort_lora.runtime.cuda_pool import bind_cuda_pool

            self.pool = None  # the pool lives on the device: write adapters with load_adapter
            self.binding = self.ort_session.io_binding()
            bind_cuda_pool(self.binding, self.cuda_pool)
            return
        shape = (m.num_layers, 2, self.num_pages, m.block_size, m.num_kv_heads, m.head_dim)
        self.pool = aligned_zeros(shape, POOL_DTYPES[m.dtype])  # allocated once, never copied
        self.binding = self.ort_session.io_binding()
        self._pool_values = []  # keep the OrtValues (and so the views) alive
        for layer in range(m.num_layers):
            for half, name in ((0, C.key_cache_name(layer)), (1, C.value_cache_name(layer))):
                view = self.pool[layer, half]
                assert view.flags.c_contiguous  # ORT would copy it, losing in-place writes
                value = ort.OrtValue.ortvalue_from_numpy(view)
                self.binding.bind_ortvalue_input(name, value)
                self._pool_values.append(value)

    def load_adapter(self, adapter_id: int, pages, write, prefetch: bool = False) -> None:
        """Put an adapter into its pool pages before the next run; write(pages, pool) fills
        a host pool array. prefetch: the next run does not use it (it may not wait for it).

        CPU: write(pages, self.pool), synchronous. CUDA: write into pinned staging, then an
        asynchronous upload; see CudaPool.wait_for_step for which uploads a run waits for.
        """
        if self.cuda_pool is None:
            write(pages, self.pool)
        else:
            staged_pages = list(range(len(pages)))  # staging is a pool of len(pages) pages
            stage = functools.partial(write, staged_pages)  # stage(staging) fills the staging
            self.cuda_pool.load(adapter_id, pages, stage, prefetch=prefetch)

    def close(self) -> None:
        """Release the ORT session, then (CUDA) the device pool with its staging, streams and
        events (CudaPool.close). The session is unusable after; closing twice is a no-op."""
        self.binding = self.ort_session = None  # ORT runs on the pool's stream: release it first
        if self.cuda_pool is not None:
            self.cuda_pool.close()

    def run(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """One step: bind the metadata inputs, run, return logits float32 [N, vocab].

        On CUDA the run first waits (on the GPU) for the adapter uploads it may touch.
        """
        t0 = time.perf_counter()
        if self.cuda_pool is not None:
            self.cuda_pool.wait_for_step()
        keep = []
        for name, value in inputs.items():
            if name not in self._input_names:
                continue  # e.g. position_ids when the graph does not read it
            if self._bound.get(name) is value:
                continue  # bound as it is, unchanged since (read-only), alive in _bound
            arr = np.ascontiguousarray(value)
            keep.append(arr)
            self.binding.bind_cpu_input(name, arr)
            if arr is value and not value.flags.writeable:
                self._bound[name] = value
            else:
                self._bound.pop(name, None)
        # logits change shape every step: let ORT allocate them afresh
        self.binding.clear_binding_outputs()
        self.binding.bind_output(C.LOGITS, "cpu")
        t1 = time.perf_counter()
        self.ort_session.run_with_iobinding(self.binding)
        t2 = time.perf_counter()
        logits = self.binding.copy_outputs_to_cpu()[0]
        t3 = time.perf_counter()
        self.timing = StepTimes({"bind": t1 - t0, RUN: t2 - t1, "fetch": t3 - t2})
        return logits
