"""The paged pool on a CUDA device, and asynchronous adapter uploads into it (S-LoRA prefetch).

One device allocation holds the whole pool, laid out like the CPU pool
[num_layers, 2 (K|V), num_pages, block_size, kv_heads, head_dim]; key_cache.{l} /
value_cache.{l} are bound by pointer offset (`pool_bind_plan`), so the graph reads and writes
the pool in place. An adapter load writes the adapter's rows (registry.write_to_pool) into a
pinned host staging buffer shaped like a pool of len(pages) pages, then copies each (half, run
of consecutive pages) across all layers with one cudaMemcpy2DAsync on a side stream
(`upload_copies`) and records an event. The next step does not block the host: before ORT
runs, its compute stream (ours, given to the CUDA EP as `user_compute_stream`) is made to wait
(cudaStreamWaitEvent) on every upload in flight except the prefetches issued for this very
step, so copies overlap with whatever the GPU is still doing and no kernel reads or writes a
page before a copy into it lands (see PrefetchTracker.events_for_step for why that suffices).

`PrefetchTracker` (prefetch.py) is the pure bookkeeping (in-flight loads, their events,
staging reuse) and `pool_bind_plan` / `upload_copies` (cuda_layout.py) are pure arithmetic:
all three are unit-tested on CPU. Here: `CudaRuntime`, the thin ctypes layer over the op
library's ort_lora_cuda_* functions; `CudaPool`, which drives them; and the ONNX Runtime glue
that runs a session on the pool's stream (`cuda_session`, `bind_cuda_pool`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np

from ort_lora import contract as C
from ort_lora.bfloat16 import float32_to_bfloat16_bits
from ort_lora.runtime.cuda_layout import Copy2D, pool_bind_plan, pool_bytes, upload_copies
from ort_lora.runtime.prefetch import Load, PrefetchTracker, Staging

H2D = 1  # cudaMemcpyHostToDevice
NOT_READY = 600  # cudaErrorNotReady


# ---- the CUDA layer ---------------------------------------------------------------------------


class CudaError(RuntimeError):
    """A CUDA call of the op library failed; the message names the call and CUDA's error."""


class CudaRuntime:
    """ctypes view of the op library's ort_lora_cuda_* helpers (nothing runs at import)."""

    def __init__(self, library: str | None = None):
        from ort_lora._lib import library_path

        self.lib = ctypes.CDLL(library or library_path())
        if not hasattr(self.lib, "ort_lora_cuda_malloc"):
            raise CudaError(
                f"{library or library_path()} was built without CUDA (no nvcc at build time)"
            )
        self.lib.ort_lora_cuda_error_string.restype = ctypes.c_char_p
        self.lib.ort_lora_cuda_error_string.argtypes = [ctypes.c_int]

    def call(self, name: str, *args) -> int:
        """Calls ort_lora_cuda_<name>; raises CudaError unless it returns 0."""
        rc = getattr(self.lib, f"ort_lora_cuda_{name}")(*args)
        if rc != 0:
            msg = self.lib.ort_lora_cuda_error_string(rc).decode(errors="replace")
            raise CudaError(f"ort_lora_cuda_{name} failed: {msg} (code {rc})")
        return rc

    def _out_ptr(self, name: str, *args) -> int:
        out = ctypes.c_void_p()
        self.call(name, ctypes.byref(out), *args)
        return int(out.value or 0)

    def device_count(self) -> int:
        n = ctypes.c_int(0)
        rc = self.lib.ort_lora_cuda_device_count(ctypes.byref(n))
        return n.value if rc == 0 else 0

    def malloc(self, nbytes: int) -> int:
        return self._out_ptr("malloc", ctypes.c_uint64(nbytes))

    def host_alloc(self, nbytes: int) -> int:
        return self._out_ptr("host_alloc", ctypes.c_uint64(nbytes))

    def stream(self) -> int:
        return self._out_ptr("stream_create")

    def event(self) -> int:
        return self._out_ptr("event_create")

    def event_done(self, event: int) -> bool:
        rc = self.lib.ort_lora_cuda_event_query(ctypes.c_void_p(event))
        if rc in (0, NOT_READY):
            return rc == 0
        return bool(self.call("event_query", ctypes.c_void_p(event)))  # raises with the message

    def copy_2d(self, dst: int, c: Copy2D, src: int, stream: int) -> None:
        args = [dst + c.dst_offset, c.dst_pitch, src + c.src_offset, c.src_pitch]
        args += [c.width, c.height]
        v, u = ctypes.c_void_p, ctypes.c_uint64
        self.call(
            "memcpy_2d_async", v(args[0]), u(args[1]), v(args[2]), u(args[3]), u(args[4]),
            u(args[5]), ctypes.c_int(H2D), v(stream),
        )  # fmt: skip


class CudaPool:
    """The device pool of one model: allocation, bindings, asynchronous adapter uploads.

    pool.compute_stream is the stream to give the CUDA EP (`user_compute_stream`);
    pool.load(adapter_id, pages, write, prefetch) stages and uploads an adapter before the
    next step; pool.wait_for_step() makes the compute stream wait for the uploads that step
    may touch (PrefetchTracker.events_for_step). Loads go through one copy stream, in order,
    so a later copy into a page also lands after an earlier one. pool.close() frees all of it
    (after the ORT session that runs on its stream is gone: ModelSession.close).
    """

    def __init__(self, manifest: C.ModelManifest, num_pages: int, runtime: CudaRuntime):
        self.manifest, self.num_pages, self.rt = manifest, num_pages, runtime
        self.closed = True  # until everything below exists: close() then has nothing to free
        if runtime.device_count() < 1:
            raise CudaError("no CUDA device is visible (cudaGetDeviceCount returned 0 or failed)")
        nbytes = pool_bytes(manifest, num_pages)
        self.base = runtime.malloc(nbytes)
        try:
            runtime.call("memset", ctypes.c_void_p(self.base), 0, ctypes.c_uint64(nbytes))
            # cudaMemset runs on the legacy default stream, which our non-blocking streams do
            # not wait for: finish it before any upload can write adapter pages
            runtime.call("stream_synchronize", ctypes.c_void_p(0))
            self.copy_stream = runtime.stream()
            self.compute_stream = runtime.stream()
        except BaseException:
            runtime.call("free", ctypes.c_void_p(self.base))
            raise
        self.tracker = PrefetchTracker()
        self.bindings = pool_bind_plan(manifest, num_pages, self.base)
        self.closed = False

    def load(
        self, adapter_id: int, pages, write: Callable[[np.ndarray], None], prefetch: bool = False
    ) -> None:
        """write(staging) fills a host pool of len(pages) pages; its pages go to `pages`.
        prefetch: the next step does not use the adapter (it need not wait for the copy)."""
        pages = [int(p) for p in pages]
        self._check_open("load an adapter")
        self.poll()
        m = self.manifest
        shape = (m.num_layers, 2, len(pages), m.block_size, m.num_kv_heads, m.head_dim)
        nbytes = int(np.prod(shape)) * 2
        staging = self.tracker.acquire(nbytes) or Staging(self.rt.host_alloc(nbytes), nbytes)
        pinned = np.ctypeslib.as_array((ctypes.c_uint16 * (nbytes // 2)).from_address(staging.ptr))[
            : nbytes // 2
        ].reshape(shape)
        try:
            if m.dtype == "float16":
                write(pinned.view(np.float16))
            else:  # numpy has no bfloat16: write float32, round to bfloat16 bits
                host = np.zeros(shape, np.float32)
                write(host)
                pinned[...] = float32_to_bfloat16_bits(host)
        except BaseException:
            self.tracker.free.append(staging)  # nothing was enqueued from it
            raise
        for c in upload_copies(m, self.num_pages, pages):
            self.rt.copy_2d(self.base, c, staging.ptr, self.copy_stream)
        event = self.rt.event()
        self.rt.call("event_record", ctypes.c_void_p(event), ctypes.c_void_p(self.copy_stream))
        self.tracker.begin(Load(adapter_id, tuple(pages), event, staging, prefetch))

    def wait_for_step(self) -> None:
        """Make the compute stream wait (on the GPU, not the host) for the uploads the step
        about to run may touch."""
        self._check_open("run a step")
        for event in self.tracker.events_for_step():
            self.rt.call(
                "stream_wait_event", ctypes.c_void_p(self.compute_stream), ctypes.c_void_p(event)
            )

    def poll(self) -> None:
        """Free the staging of finished uploads and destroy their events."""
        for ld in self.tracker.retire(self.rt.event_done):
            self.rt.call("event_destroy", ctypes.c_void_p(ld.event))

    def synchronize(self) -> None:
        """Block until every upload has landed (tests, shutdown)."""
        self.rt.call("stream_synchronize", ctypes.c_void_p(self.copy_stream))
        self.poll()

    def close(self) -> None:
        """Free the device pool, the pinned staging, the events and both streams, and what the
        LoraSGMV op keeps for the compute stream (its plan uploads and scratch). Waits for both
        streams first. The ORT session that runs on compute_stream must be gone. Idempotent."""
        if self.closed:
            return
        self.closed = True
        inflight, free = self.tracker.inflight, self.tracker.free
        self.tracker, self.bindings = PrefetchTracker(), []
        streams = (self.copy_stream, self.compute_stream)
        steps = [("stream_synchronize", s) for s in streams]
        steps += [("event_destroy", ld.event) for ld in inflight]
        steps += [("host_free", b.ptr) for b in [ld.staging for ld in inflight] + free]
        steps += [("sgmv_release_stream", self.compute_stream)]
        steps += [("stream_destroy", s) for s in streams] + [("free", self.base)]
        errors = []
        for name, handle in steps:  # every step runs; the first failure is raised at the end
            try:
                self.rt.call(name, ctypes.c_void_p(handle))
            except CudaError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise CudaError(f"cannot {what}: this CudaPool is closed (its device memory is freed)")


# ---- ONNX Runtime glue (used by ModelSession(device="cuda")) ----------------------------------

ORT_ELEMENT_TYPES = {"float16": np.float16, "bfloat16": 16}  # 16: TensorProto.BFLOAT16


def require_cuda() -> None:
    """Raise CudaError naming what is missing unless a CUDA run can start here: the op library
    built with CUDA, a visible device, and onnxruntime with CUDAExecutionProvider."""
    import onnxruntime as ort

    if CudaRuntime().device_count() < 1:
        raise CudaError("no CUDA device is visible (cudaGetDeviceCount returned 0 or failed)")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise CudaError(
            f"onnxruntime {ort.__version__} has no CUDAExecutionProvider "
            f"(available: {ort.get_available_providers()}); install onnxruntime-gpu"
        )


def cuda_providers(pool: CudaPool, device_id: int = 0) -> list:
    """CUDA EP options that run the graph on pool.compute_stream, CPU EP for the rest."""
    require_cuda()
    options = {
        "device_id": str(device_id),
        "has_user_compute_stream": "1",
        "user_compute_stream": str(pool.compute_stream),
    }
    return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]


def cuda_session(model_path, sess_options, pool: CudaPool, device_id: int = 0):
    """An onnxruntime.InferenceSession of model_path on CUDA, running on pool.compute_stream.

    ORT's Python session retries a failed CUDA session on the CPU provider alone and then
    raises that retry's error ("Could not find an implementation for ..."), hiding the reason;
    and a CUDA provider that fails to load is skipped with a warning. Here neither passes: the
    fallback is off, an error is raised as CudaError with ORT's own first cause, and a session
    whose first provider is not CUDAExecutionProvider is refused.
    """
    import onnxruntime as ort

    providers = cuda_providers(pool, device_id)
    try:
        session = ort.InferenceSession(
            str(model_path), sess_options=sess_options, providers=providers, enable_fallback=0
        )
    except Exception as e:
        cause = first_cause(e)
        raise CudaError(
            f"onnxruntime could not create a CUDA session for {model_path}: "
            f"{type(cause).__name__}: {cause}"
        ) from e
    got = session.get_providers()
    if not got or got[0] != "CUDAExecutionProvider":
        del session
        raise CudaError(
            f"onnxruntime created the session for {model_path} with providers {got}: "
            "CUDAExecutionProvider is not first (it failed to load; ORT's log above says why, "
            "often missing CUDA or cuDNN libraries: see onnxruntime.preload_dlls())"
        )
    return session


def first_cause(error: BaseException) -> BaseException:
    """The innermost exception `raise ... from` chained to `error` (itself if none)."""
    seen = {id(error)}
    while error.__cause__ is not None and id(error.__cause__) not in seen:
        error = error.__cause__
        seen.add(id(error))
    return error


def bind_cuda_pool(binding, pool: CudaPool, device_id: int = 0) -> None:
    """Bind every key_cache.{l} / value_cache.{l} to its slice of the device pool."""
    element = ORT_ELEMENT_TYPES[pool.manifest.dtype]
    for b in pool.bindings:
        binding.bind_input(b.name, "cuda", device_id, element, list(b.shape), b.ptr)
