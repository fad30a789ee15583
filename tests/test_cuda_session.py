"""ModelSession(device="cuda") around ONNX Runtime, on CPU: how the CUDA session is created
(cuda_pool.cuda_session) and what closing frees. ORT's InferenceSession is replaced by fakes
that behave as the CUDA build does on failure; the device pool runs over host memory
(test_cuda_pool.HostMemoryRuntime). The GPU side is bench/gpu_check.py's e2e section.
"""

from __future__ import annotations

import weakref

import onnxruntime
import pytest
from test_cuda_pool import HostMemoryRuntime, manifest

from ort_lora.runtime import cuda_pool
from ort_lora.runtime.cuda_pool import CudaError, CudaPool
from ort_lora.runtime.session import ModelSession

CPU_RETRY_ERROR = "Could not find an implementation for PagedAttention(1) node"
CUDA_CAUSE = "CUDA failure 100: no CUDA-capable device is detected"


class FakeSession:
    """What ModelSession uses of onnxruntime.InferenceSession. `fail` raises as ORT's Python
    session does after its CPU retry: the retry's error, chained from the CUDA one."""

    created: list[dict] = []
    fail = False
    providers = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    released: list[int] = []  # the number of each instance destroyed (its index in created)

    def __init__(self, path, sess_options=None, providers=None, **kwargs):
        self.number = len(FakeSession.created)
        FakeSession.created.append({"path": path, "providers": providers, **kwargs})
        if FakeSession.fail:
            try:
                raise RuntimeError(CUDA_CAUSE)
            except RuntimeError as e:
                raise RuntimeError(CPU_RETRY_ERROR) from e

    def get_providers(self):
        return FakeSession.providers

    def get_inputs(self):
        return []

    def io_binding(self):
        return FakeBinding()

    def __del__(self):
        FakeSession.released.append(self.number)


class FakeBinding:
    def bind_input(self, *args):
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    """ORT's session replaced by FakeSession, the CUDA runtime by host memory; yields the
    runtime the pools of this test use."""
    rt = HostMemoryRuntime()
    monkeypatch.setattr(onnxruntime, "InferenceSession", FakeSession)
    monkeypatch.setattr(cuda_pool, "CudaRuntime", lambda: rt)
    monkeypatch.setattr(cuda_pool, "require_cuda", lambda: None)
    monkeypatch.setattr(FakeSession, "created", [])
    monkeypatch.setattr(FakeSession, "released", [])
    yield rt


@pytest.fixture
def cuda_model_dir(tmp_path):
    """A directory holding only the manifest of a float16 --device cuda export."""
    manifest().save(tmp_path)
    return tmp_path


def test_a_failed_cuda_session_names_orts_first_cause_and_never_falls_back(fake_cuda, monkeypatch):
    pool = CudaPool(manifest(), 4, fake_cuda)
    monkeypatch.setattr(FakeSession, "fail", True)
    with pytest.raises(CudaError) as err:
        cuda_pool.cuda_session("m.onnx", None, pool)
    assert f"could not create a CUDA session for m.onnx: RuntimeError: {CUDA_CAUSE}" in str(
        err.value
    )
    assert CPU_RETRY_ERROR not in str(err.value)
    created = FakeSession.created[0]
    assert created["enable_fallback"] == 0  # no CPU retry at creation, none at run time
    name, options = created["providers"][0]
    assert name == "CUDAExecutionProvider"
    assert options["user_compute_stream"] == str(pool.compute_stream)


def test_a_session_without_cuda_first_is_refused(fake_cuda, monkeypatch):
    pool = CudaPool(manifest(), 4, fake_cuda)
    monkeypatch.setattr(FakeSession, "providers", ["CPUExecutionProvider"])
    with pytest.raises(CudaError, match=r"providers \['CPUExecutionProvider'\]: CUDAExecution"):
        cuda_pool.cuda_session("m.onnx", None, pool)
    assert 0 in FakeSession.released  # not kept alive by the error


def test_model_session_closes_its_pool_when_the_cuda_session_fails(
    fake_cuda, cuda_model_dir, monkeypatch
):
    monkeypatch.setattr(FakeSession, "fail", True)
    with pytest.raises(CudaError, match="CUDA failure 100"):
        ModelSession(cuda_model_dir, num_pages=4, device="cuda")
    names = [c[0] for c in fake_cuda.calls]
    assert names.count("free") == 1 and names.count("stream_destroy") == 2


def test_closing_the_session_releases_ort_before_the_pool(fake_cuda, cuda_model_dir, monkeypatch):
    session = ModelSession(cuda_model_dir, num_pages=4, device="cuda")
    ort_session, pool = weakref.ref(session.ort_session), session.cuda_pool
    number = session.ort_session.number
    ort_released_at_call = []  # for each CUDA call of the close: was ORT's session gone?
    real_call = fake_cuda.call

    def call(name, *args):
        ort_released_at_call.append(number in FakeSession.released)
        return real_call(name, *args)

    monkeypatch.setattr(fake_cuda, "call", call)
    session.close()
    assert ort_session() is None and pool.closed
    assert ort_released_at_call and all(ort_released_at_call)
    session.close()  # no-op
