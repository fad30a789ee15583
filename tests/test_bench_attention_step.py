"""bench/bench_attention_step.py's harness: its cases, a step's calls (each layer's cache, or
layer 0's for every layer) and another build timed in turn (the numbers themselves are the
benchmark's, never checked here)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from script_module import assert_usage_error, load_script

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_attention_step.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT, argv=["--threads", "1"])  # read at import (bench_ops)


def test_cases_are_requests_x_context(bench):
    assert bench.parse_cases("1x2000,32x256") == [(1, 2000), (32, 256)]
    for bad in ("1x", "x5", "0x100", "2by3", "1x-4"):
        with pytest.raises(ValueError, match="REQUESTSxCONTEXT"):
            bench.parse_cases(bad)


def test_a_step_calls_every_layer_or_layer_0_for_all(bench):
    calls = []
    runs = [lambda i=i: calls.append(i) for i in range(4)]
    bench.step(runs, cached=False)()
    bench.step(runs, cached=True)()
    assert calls == [0, 1, 2, 3, 0, 0, 0, 0]


def test_another_build_in_turn(bench, monkeypatch, tmp_path):
    import ort_lora

    monkeypatch.setattr(bench, "LAYERS", 2)
    other = tmp_path / "other.so"
    shutil.copy(ort_lora.library_path(), other)
    row = bench.bench_case(1, 40, 2, str(other))
    assert row["case"] == "1x40" and row["kv_mb"] == pytest.approx(2 * 2 * 40 * 3 * 64 * 4 / 1e6)
    assert row["vs_library"] == row["other_ms"] / row["memory_ms"]
    assert all(row[f"{v}_ms"] > 0 for v in ("memory", "cached", "other"))
    assert "vs_library" not in bench.bench_case(1, 40, 2, None)


@pytest.mark.parametrize(
    "argv, says",
    [(["--cases", "1x"], "--cases"), (["--against-library", "/no/such.so"], "--against-library")],
)
def test_bad_arguments_name_the_option(bench, argv, says, capsys):
    assert_usage_error(bench.main, argv, says, capsys)
