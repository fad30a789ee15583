"""bench/bench_row_precision.py on its tiny set: what it measures tells the row types apart
(finer rows move logprobs less), and the int16 rows it emulates round as stated."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("peft")
SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_row_precision.py"


def test_int16_rows_round_to_a_row_scale():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from bench_row_precision import INT16_MAX, int16_rows
    finally:
        sys.path.remove(str(SCRIPT.parent))
    rows = np.array([[0.5, -1.0, 0.25 + 1e-7], [0.0, 0.0, 0.0]], np.float32)
    got = int16_rows(rows)
    step = 1.0 / INT16_MAX  # the first row's peak is 1
    np.testing.assert_allclose(got[0], np.rint(rows[0] / step) * step, rtol=1e-6)
    assert np.abs(got[0] - rows[0]).max() <= step / 2 * (1 + 1e-6)
    assert not got[1].any()  # a zero row stays zero (no division by its peak)


def test_tiny_set_orders_row_types_by_precision(tmp_path):
    out = tmp_path / "precision.json"
    cmd = [sys.executable, str(SCRIPT), "--sets", "tiny", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    worst = {t: r["max_abs_logprob"] for t, r in result["sets"]["tiny"].items()}
    assert set(worst) == {"bfloat16", "float16", "int8", "int16"}
    # the tests' adapters are float32: every smaller row moves them, the finer ones less
    assert 0 < worst["int16"] < worst["float16"] < worst["bfloat16"] < worst["int8"]
    assert result["tolerance"] == 1e-4 and "command" in result and "machine" in result
