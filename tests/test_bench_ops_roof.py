"""bench/bench_ops.py's QuantMatMul context: the int8 multiply-add and float32 FMA roofs it
builds from bench/int8_roof.cc, the kernel ISA it reports and the other build it can time
beside this one, QuantMatMul's and PagedAttention's (the numbers themselves are the
benchmark's, never checked here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from script_module import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_ops.py"


@pytest.fixture(scope="module")
def bench_ops():
    # it reads --threads from argv at import; 2 threads: a pool per session would add a thread
    return load_script(SCRIPT, argv=["--threads", "2"])


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_roof_builds_and_measures_the_isas_this_cpu_has(bench_ops):
    roof = bench_ops.int8_roof()
    assert "error" not in roof, roof
    flags = cpu_flags()
    if "avx2" in flags:
        assert roof["avx2_gops"] > 1.0
        # the 4-bit kernel's loop does more than vpmaddubsw: below the instruction's roof
        assert 1.0 < roof["avx2_q4_loop_gops"] < roof["avx2_gops"]
    if "avx512_vnni" in flags:
        assert roof["avx512_vnni_gops"] > 1.0
    else:
        assert roof["avx512_vnni_gops"] is None
    if {"avx2", "fma"} <= flags:
        assert roof["fma_ymm_gflops"] > 1.0
    if "avx512f" in flags:
        assert roof["fma_zmm_gflops"] > 1.0
    else:
        assert roof["fma_zmm_gflops"] is None


def test_quant_isa_follows_the_cap(bench_ops, monkeypatch):
    flags = cpu_flags()
    monkeypatch.setenv("ORT_LORA_QUANT_ISA", "baseline")
    assert bench_ops.quant_isa() == "baseline"
    monkeypatch.setenv("ORT_LORA_QUANT_ISA", "avx2")
    assert bench_ops.quant_isa() == ("avx2" if "avx2" in flags else "baseline")
    monkeypatch.delenv("ORT_LORA_QUANT_ISA")
    widest = "avx512-vnni" if "avx512_vnni" in flags else "avx2"
    assert bench_ops.quant_isa() == widest


def test_roof_reports_a_compiler_failure(bench_ops, monkeypatch):
    monkeypatch.setenv("CXX", "false")
    assert "failed" in bench_ops.int8_roof()["error"]


def test_paired_times_rotates_the_order_and_keeps_each_fns_times(bench_ops):
    """Every fn takes every place in the turn equally often, and each fn's times are its own
    (a fake clock that fn i moves on by i + 1)."""
    now, order = [0.0], []

    def fn(i):
        def run():
            order.append(i)
            now[0] += i + 1

        return run

    times = bench_ops.paired_times([fn(i) for i in range(3)], 6, lambda: now[0], warmup=1)
    assert [median for median, _ in times] == [1.0, 2.0, 3.0]
    timed = [order[3 + 3 * r : 6 + 3 * r] for r in range(6)]  # after the warm-up turn
    assert [turn[0] for turn in timed] == [0, 1, 2, 0, 1, 2]
    assert all(sorted(turn) == [0, 1, 2] for turn in timed)


def test_against_library_times_the_same_weights_in_another_build(bench_ops, tmp_path):
    """--against-library: the other build's QuantMatMul on the first session's weights, in
    both forms for 4 bits (its outputs are checked to agree within float rounding before
    timing, so other weights would stop the run), timed in turn; a copy of this checkout's
    library stands in for another build, so they agree to the bit."""
    import shutil
    import time

    import ort_lora

    other = tmp_path / "other.so"
    shutil.copy(ort_lora.library_path(), other)
    row = bench_ops.bench_quant("t", 3, 64, 80, 4, 2, 2, 0, time.perf_counter, against=str(other))
    assert row["vs_library"] > 0 and row["gguf_vs_library"] > 0 and row["library_max_diff"] == 0
    head = bench_ops.bench_quant("t", 3, 64, 80, 8, 2, 2, 0, time.perf_counter, against=str(other))
    assert head["vs_library"] > 0 and "gguf_vs_library" not in head
    assert "vs_library" not in bench_ops.bench_quant("t", 3, 64, 80, 4, 2, 2, 0, time.perf_counter)


def test_against_library_stops_on_outputs_past_rounding(bench_ops, tmp_path, monkeypatch):
    """A build whose QuantMatMul reads other weights (here: drawn from another seed) stops the
    run before anything is timed, naming how far apart the outputs are."""
    import shutil
    import time

    import numpy as np

    import ort_lora

    other = tmp_path / "other.so"
    shutil.copy(ort_lora.library_path(), other)
    session = bench_ops.quant_session

    def other_weights(kind, k, n, bits, layers, rng, library=None):
        rng = np.random.default_rng(7) if library else rng
        return session(kind, k, n, bits, layers, rng, library)

    monkeypatch.setattr(bench_ops, "quant_session", other_weights)
    with pytest.raises(SystemExit, match="past float rounding"):
        bench_ops.bench_quant("t", 3, 64, 80, 4, 2, 2, 0, time.perf_counter, against=str(other))


def test_the_default_models_form_carries_the_same_weights(bench_ops):
    """gguf_*: the 4-bit weights again in GGUF Q4_1's form (no zero points, a float offset per
    block), which the default model runs: products of the same W, both within x's int8
    rounding of the float product; the 8-bit head has no such form."""
    import time

    import numpy as np

    from ort_lora.export.quant import quantize_rtn

    def session(kind):
        return bench_ops.quant_session(kind, 64, 80, 4, 1, np.random.default_rng(7))

    x = {"x": np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)}
    w = np.random.default_rng(7).standard_normal((80, 64)).astype(np.float32) * 0.05
    exact = x["x"] @ quantize_rtn(w, 4, 32, symmetric=False).dequantize().T
    zeros_form, gguf_form = session("quant").run(None, x)[0], session("gguf").run(None, x)[0]
    for y in (zeros_form, gguf_form):
        np.testing.assert_allclose(y, exact, rtol=0, atol=2e-2 * np.abs(exact).max())
    assert not np.array_equal(zeros_form, gguf_form)  # the offsets input is really used
    row = bench_ops.bench_quant("t", 3, 64, 80, 4, 2, 2, 0, time.perf_counter)
    assert row["gguf_ms"] > 0 and row["gguf_vs_nbits"] > 0 and row["gguf_vs_f32"] > 0
    assert "gguf_ms" not in bench_ops.bench_quant("t", 3, 64, 80, 8, 2, 2, 0, time.perf_counter)


POOL_PROBE = """
import importlib.util, os, sys
import numpy as np
sys.argv = [sys.argv[1], "--threads", "2"]  # bench_ops reads --threads at import
spec = importlib.util.spec_from_file_location("bench_ops", sys.argv[0])
bench_ops = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_ops)
bench_ops.share_one_pool()
def session():
    sess = bench_ops.quant_session("quant", 64, 80, 4, 1, np.random.default_rng(0))
    sess.run(None, {"x": np.ones((3, 64), np.float32)})
    return sess
first = session()
threads = len(os.listdir("/proc/self/task"))
more = [session() for _ in range(3)]
import onnxruntime as ort, ort_lora  # an engine's sessions: ort_lora's session_options
from onnx import helper
x, y = (helper.make_tensor_value_info(n, 1, [1]) for n in "xy")
graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
opts = ort_lora.session_options(intra_op_num_threads=2)
engine = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
engine.run(None, {"x": np.ones(1, np.float32)})
print(threads, len(os.listdir("/proc/self/task")))
"""


def test_benchmark_sessions_share_one_thread_pool():
    """After share_one_pool (the benchmark programs' first step) every session runs on the
    process's one pool of THREADS threads, an engine's too (ort_lora.session_options):
    sessions made after the first add no thread (a pool each would add THREADS - 1 each, whose
    spinning workers took a core from the session timed next). In a process of its own: ORT
    then refuses sessions with pools of their own."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", POOL_PROBE, str(SCRIPT)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    before, after = map(int, done.stdout.split())
    assert after == before


def test_against_library_times_paged_attention_in_another_build(bench_ops, tmp_path):
    """--against-library also reaches PagedAttention's cases: a decode and a prefill timed in
    turn with the other build on the same inputs, the outputs checked first (a copy of this
    checkout's library: the same bits)."""
    import shutil
    import time

    import ort_lora

    other = str(shutil.copy(ort_lora.library_path(), tmp_path / "other.so"))
    clock = time.perf_counter
    decode = bench_ops.bench_paged_attention(2, 40, 4, 2, 16, 16, 2, 0, clock, against=other)
    prefill = bench_ops.bench_paged_attention_prefill(8, 24, 4, 2, 16, 16, 2, 0, clock, other)
    for row in (decode, prefill):
        assert row["vs_library"] > 0 and row["library_max_diff"] == 0 and row["op_ms"] > 0
    assert "vs_library" not in bench_ops.bench_paged_attention_prefill(
        8, 24, 4, 2, 16, 16, 2, 0, clock
    )
