"""A test file's tests again in a subprocess with one of the op library's variables set: a
narrower ISA copy of a kernel (AVX2, baseline; ORT_LORA_*_ISA), or the ONNX Runtime C API 21
way of reading inputs' shapes (ORT_LORA_ORT_API=21)."""

from __future__ import annotations

import os
import subprocess
import sys


def assert_passes_with(test_files: str | list[str], cases: str, variable: str, value: str) -> None:
    """pytest `test_files -k cases` with os.environ[variable] = value passes (some tests ran)."""
    files = [test_files] if isinstance(test_files, str) else test_files
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-k", cases]
    env = os.environ | {variable: value}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
