"""One forward step of an exported model through ONNX Runtime with IOBinding.

The paged pool is ONE numpy array [num_layers, 2 (K|V), num_pages, block_size, kv_heads,
head_dim], allocated once; every key_cache.{l} / value_cache.{l} input is bound once to a view
of it (pool[l, 0] / pool[l, 1], C-contiguous, shared memory: the ops write KV and read adapter
rows in place). Each step binds only the small metadata inputs and fetches the logits.
The inputs come from a StepPlan (engine/model_runner.py); this module knows only the graph.
A session may also load the base graph (runtime/base_graph.py) for steps without adapters:
a second ORT session over the same mapped weights file, its own binding of the same pool.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ort_lora import contract as C
from ort_lora.errors import logger
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
class BoundGraph:
    """One ONNX Runtime session of the export and its IOBinding, the pool bound once.

    bound: the read-only arrays bound by the last run, by input name: a decode step's LoRA
    tables are usually the step before's (the registry's cached arrays, read-only: 38 of 48
    inputs), and binding them again took 1-2 % of a one-request decode step.
    """

    session: object  # onnxruntime.InferenceSession
    binding: object = field(init=False)  # its IOBinding
    input_names: frozenset[str] = field(init=False)
    bound: dict[str, np.ndarray] = field(default_factory=dict, init=False)

    def __post_init__(self):
        self.binding = self.session.io_binding()
        self.input_names = frozenset(i.name for i in self.session.get_inputs())

    def bind_fixed(self, name: str, value: np.ndarray) -> None:
        """Bind a read-only array until a run binds another under its name."""
        value.setflags(write=False)
        self.bound[name] = value
        self.binding.bind_cpu_input(name, value)

    def run(self, inputs: dict[str, np.ndarray]) -> tuple[np.ndarray, StepTimes]:
        """Bind the inputs this graph reads, run, return (logits float32 [N, vocab], times)."""
        t0 = time.perf_counter()
        keep = []
        for name, value in inputs.items():
            if name not in self.input_names:
                continue  # e.g. position_ids when the graph does not read it
            if self.bound.get(name) is value:
                continue  # bound as it is, unchanged since (read-only), alive in bound
            arr = np.ascontiguousarray(value)
            keep.append(arr)
            self.binding.bind_cpu_input(name, arr)
            if arr is value and not value.flags.writeable:
                self.bound[name] = value
            else:
                self.bound.pop(name, None)
        # logits change shape every step: let ORT allocate them afresh
        self.binding.clear_binding_outputs()
        self.binding.bind_output(C.LOGITS, "cpu")
        t1 = time.perf_counter()
        self.session.run_with_iobinding(self.binding)
        t2 = time.perf_counter()
        logits = self.binding.copy_outputs_to_cpu()[0]
        t3 = time.perf_counter()
        return logits, StepTimes({"bind": t1 - t0, RUN: t2 - t1, "fetch": t3 - t2})


@dataclass
class ModelSession:
    """An exported model loaded in ONNX Runtime (CPU), with its paged pool bound once.

    session.pool: numpy [num_layers, 2, num_pages, block_size, kv_heads, head_dim]; the
    adapter registry writes adapter rows into it (through load_adapter). With device="cuda"
    the pool lives on the GPU (session.cuda_pool) and session.pool is None.
    session.run(inputs) -> logits [N, vocab]; session.run(inputs, adapters=False): a step in
    which no row has an adapter (the LoRA inputs may be left out), on the base graph if the
    session has one.

    base_graph: also load the export without its LoraSGMV nodes (runtime/base_graph.py) over
    the same weights and pool, for steps without adapters (CPU). None: where its weights are
    read in place, so that the second session holds no copy of them.
    """

    model_dir: str | Path
    num_pages: int
    intra_op_num_threads: int | None = None
    device: str = "cpu"  # "cpu" (numpy pool) or "cuda" (device pool, runtime/cuda_pool.py)
    base_graph: bool | None = False
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
        if self.base_graph and self.device != "cpu":
            raise ValueError("a base graph runs on device cpu only")
        opts = {"intra_op_num_threads": self.intra_op_num_threads}
        opts = {k: v for k, v in opts.items() if v is not None}
        model_path = self.model_dir / C.MODEL_NAME
        self.cuda_pool = self.base = None
        if self.device == "cuda":
            from ort_lora.runtime import cuda_pool

            self.cuda_pool = cuda_pool.CudaPool(
                self.manifest, self.num_pages, cuda_pool.CudaRuntime()
            )
            try:  # CudaError with ORT's own cause; CUDA provider first or refused
                session = cuda_pool.cuda_session(
                    model_path, ort_lora.session_options(**opts), self.cuda_pool
                )
            except BaseException:
                self.cuda_pool.close()
                raise
        else:
            session = ort.InferenceSession(
                str(model_path),
                sess_options=ort_lora.session_options(**opts),
                providers=["CPUExecutionProvider"],
            )
        self.graph = BoundGraph(session)
        if self.device == "cpu" and self.base_graph is not False:
            self.base = self._load_base_graph(opts)
        self._bind_pool()
        if C.LORA_ROW_TYPES in self.graph.input_names:  # until a run gives them: [0], every
            self.graph.bind_fixed(C.LORA_ROW_TYPES, np.zeros(0, np.int32))  # slot's rows float32

    @property
    def ort_session(self):
        """The export's ONNX Runtime session (the graph with LoraSGMV nodes)."""
        return self.graph.session if self.graph is not None else None

    @property
    def binding(self):
        return self.graph.binding if self.graph is not None else None

    @property
    def graphs(self) -> list[BoundGraph]:
        """The loaded graphs: the export's, then the base graph if there is one."""
        return [g for g in (self.graph, self.base) if g is not None]

    def _load_base_graph(self, opts: dict) -> BoundGraph | None:
        """The base graph's session over the export's weights file (mapped, not copied), or
        None when base_graph is None and a second session would copy the weights or cannot be
        made (logged: every step then runs the export's graph)."""
        import onnx
        import onnxruntime as ort

        import ort_lora
        from ort_lora.runtime.base_graph import reads_weights_in_place, without_lora_nodes

        model_path = self.model_dir / C.MODEL_NAME
        model = onnx.load(str(model_path), load_external_data=False)
        if self.base_graph is None and not reads_weights_in_place(model):
            return None
        options = ort_lora.session_options(**opts)
        folder = "session.model_external_initializers_file_folder_path"
        options.add_session_config_entry(folder, str(self.model_dir))
        if options.enable_profiling:  # its own trace beside the export's
            options.profile_file_prefix += "_base_graph"
        try:
            session = ort.InferenceSession(
                without_lora_nodes(model).SerializeToString(),
                sess_options=options,
                providers=["CPUExecutionProvider"],
            )
        except Exception as exc:  # e.g. an ONNX Runtime without the external-data folder key
            if self.base_graph:
                raise
            logger.warning("no base graph for %s (every step runs the export): %s", model_path, exc)
            return None
        return BoundGraph(session)

    def _bind_pool(self) -> None:
        import onnxruntime as ort

        m = self.manifest
        if self.cuda_pool is not None:
            from ort_lora.runtime.cuda_pool import bind_cuda_pool

            self.pool = None  # the pool lives on the device: write adapters with load_adapter
            bind_cuda_pool(self.binding, self.cuda_pool)
            return
        shape = (m.num_layers, 2, self.num_pages, m.block_size, m.num_kv_heads, m.head_dim)
        self.pool = aligned_zeros(shape, POOL_DTYPES[m.dtype])  # allocated once, never copied
        self._pool_values = []  # keep the OrtValues (and so the views) alive
        for layer in range(m.num_layers):
            for half, name in ((0, C.key_cache_name(layer)), (1, C.value_cache_name(layer))):
                view = self.pool[layer, half]
                assert view.flags.c_contiguous  # ORT would copy it, losing in-place writes
                value = ort.OrtValue.ortvalue_from_numpy(view)
                for graph in self.graphs:
                    graph.binding.bind_ortvalue_input(name, value)
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
        """Release the ORT sessions, then (CUDA) the device pool with its staging, streams and
        events (CudaPool.close). The session is unusable after; closing twice is a no-op."""
        self.graph = self.base = None  # ORT runs on the pool's stream: release it first
        if self.cuda_pool is not None:
            self.cuda_pool.close()

    def run(self, inputs: dict[str, np.ndarray], adapters: bool = True) -> np.ndarray:
        """One step: bind the metadata inputs, run, return logits float32 [N, vocab].
        adapters=False: no row of the step has an adapter (the base graph runs it if loaded).

        On CUDA the run first waits (on the GPU) for the adapter uploads it may touch.
        """
        t0 = time.perf_counter()
        if self.cuda_pool is not None:
            self.cuda_pool.wait_for_step()
        waited = time.perf_counter() - t0
        graph = self.base if not adapters and self.base is not None else self.graph
        logits, self.timing = graph.run(inputs)
        self.timing.phases["bind"] += waited
        return logits
