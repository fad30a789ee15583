"""bench/gpu_check.py's verdict, on a machine without a GPU: a skipped section is NOT VERIFIED
(exit 3, or 0 with --allow-skip), a failed one exit 1; the end-to-end section is skipped, not
passed, without CUDAExecutionProvider; the build fails without nvcc instead of building a
CPU-only library."""

from __future__ import annotations

import argparse
from pathlib import Path

import onnxruntime
import pytest
from script_module import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


@pytest.fixture
def gpu_check(monkeypatch):
    module = load_script(SCRIPT)
    monkeypatch.setattr(module, "RESULTS", {})
    return module


@pytest.mark.parametrize(
    "statuses, allow_skip, want",
    [
        (["ok", "ok"], False, ("VERIFIED", 0)),
        (["ok", "SKIPPED"], False, ("NOT VERIFIED (a section was skipped)", 3)),
        (["ok", "SKIPPED"], True, ("NOT VERIFIED (a section was skipped)", 0)),
        (["FAILED", "SKIPPED"], True, ("FAILED", 1)),
    ],
)
def test_verdict(gpu_check, statuses, allow_skip, want):
    gpu_check.RESULTS.update({f"s{i}": {"status": s} for i, s in enumerate(statuses)})
    assert gpu_check.verdict(allow_skip) == want


def test_end_to_end_without_a_cuda_provider_is_skipped_not_passed(gpu_check):
    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime here has CUDAExecutionProvider: this checks the CPU build")
    gpu_check.e2e(argparse.Namespace())
    result = gpu_check.RESULTS["e2e"]
    assert result["status"] == "SKIPPED" and "end to end NOT checked" in result["reason"]
    assert gpu_check.verdict(False)[1] == 3


def test_the_build_fails_without_nvcc(gpu_check, tmp_path, monkeypatch):
    monkeypatch.delenv("ORT_LORA_LIBRARY", raising=False)
    args = argparse.Namespace(nvcc=str(tmp_path / "no" / "nvcc"), ort_include="",
                              build_dir=str(tmp_path / "build"))  # fmt: skip
    gpu_check.build(args)
    result = gpu_check.RESULTS["build"]
    assert result["status"] == "FAILED" and "nvcc not found" in result["error"]
    assert "ORT_LORA_LIBRARY" not in gpu_check.os.environ
    assert not (tmp_path / "build").exists()  # nothing was configured
