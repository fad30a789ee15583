"""bench/bench_lora_step.py's --against-library: another build's LoraSGMV step, checked against
the reference and timed in turn with this checkout's (the numbers themselves are the
benchmark's, never checked here)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from script_module import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_lora_step.py"


@pytest.fixture(scope="module")
def bench_lora_step():
    return load_script(SCRIPT, argv=["--threads", "1"])  # read at import (bench_ops)


@pytest.fixture
def other_build(bench_lora_step, monkeypatch, tmp_path) -> str:
    """A copy of this checkout's library standing in for another build; steps of one layer."""
    import ort_lora

    monkeypatch.setattr(bench_lora_step, "LAYERS", 1)
    other = tmp_path / "other.so"
    shutil.copy(ort_lora.library_path(), other)
    return str(other)


@pytest.mark.parametrize("rows", [32, 1])
def test_against_library_times_another_builds_step(bench_lora_step, other_build, rows):
    """One layer's step (32 rows over 16 adapters, or one request's row on one adapter): the
    other build runs the fused step on the same rows, its outputs checked against the reference
    first, then in turn."""
    other = other_build
    row = bench_lora_step.bench_dtype("int8", rows, 2, 0, ["fused"], False, against=other)
    assert row["other_ms"] > 0 and row["vs_library"] == row["other_ms"] / row["fused_ms"]
    assert "vs_library" not in bench_lora_step.bench_dtype("int8", rows, 2, 0, ["fused"], False)
    adapters = min(rows, 16)  # the rows' bytes: those of the adapters the rows use
    assert row["row_mb"] * 1e6 == pytest.approx(
        bench_lora_step.row_bytes_per_step("int8", adapters)
    )


def test_one_row_is_one_segment_on_adapter_0(bench_lora_step):
    import numpy as np

    feeds = bench_lora_step.step_feeds(np.random.default_rng(0), "int8", 1)
    assert feeds["seg_starts"].tolist() == [0, 1] and feeds["seg_slots"].tolist() == [0]
    assert feeds["x_h"].shape == (1, 576) and feeds["y_down"].shape == (1, 576)


def test_adapters_spread_the_rows_over_the_first_ones(bench_lora_step):
    import numpy as np

    feeds = bench_lora_step.step_feeds(np.random.default_rng(0), "int8", 32, adapters=2)
    assert feeds["seg_starts"].tolist() == [0, 16, 32] and feeds["seg_slots"].tolist() == [0, 1]
    row = bench_lora_step.bench_dtype("int8", 32, 1, 0, ["fused"], False, adapters=1)
    assert row["adapters"] == 1  # the rows' bytes are one adapter's
    assert row["row_mb"] * 1e6 == pytest.approx(bench_lora_step.row_bytes_per_step("int8", 1))


def test_against_library_refuses_a_build_that_computes_otherwise(
    bench_lora_step, other_build, monkeypatch
):
    """The other build's step is checked against the reference before any timing, and a
    failed check stops the run (the check is made to fail for it, as for a wrong kernel)."""
    other = other_build
    checked = []
    plain = bench_lora_step.check_one_layer

    def check(groups, dtype, feeds, library=None):
        checked.append(library)
        if library is not None:
            raise AssertionError("differs")
        plain(groups, dtype, feeds, library)

    monkeypatch.setattr(bench_lora_step, "check_one_layer", check)
    with pytest.raises(AssertionError, match="differs"):
        bench_lora_step.bench_dtype("int8", 32, 2, 0, ["fused"], False, against=other)
    assert checked == [None, other]
