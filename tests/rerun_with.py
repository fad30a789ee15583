"""The kernels' narrower ISA copies (AVX2, baseline) run through a test file's value tests:
the same file again in a subprocess, with the op library's ISA variable forcing that copy."""

from __future__ import annotations

import os
import subprocess
import sys


def assert_passes_with_isa(test_file: str, cases: str, variable: str, isa: str) -> None:
    """pytest `test_file -k cases` with os.environ[variable] = isa passes (some tests ran)."""
    cmd = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", "-k", cases]
    env = os.environ | {variable: isa}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
