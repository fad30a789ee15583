"""Op benchmark: the ort_lora CPU kernels against the hardware's simple baselines.

  LoraSGMV        vs numpy (BLAS) matmuls doing the same FLOPs on dense, gathered weights:
                  x_s @ A_s^T, then @ B_s^T, per segment  -> FLOP-rate ratio (target >= 50 %)
  LoraSGMV rows   float32 vs bfloat16 and int8 adapter rows (attribute adapter_dtype = 16, 3)
                  at decode and prefill shapes -> speedup and bytes moved per call
  LoraSGMV mixes  DoRA segments vs plain LoRA of the same rank (target: within 5 %), and
                  segments composing 2 adapters vs 1 (target: the extra cost is the second
                  adapter's bytes: compare with one adapter of twice the rank, same bytes)
  PagedAttention  decode vs np.copyto of the same K+V bytes -> bandwidth ratio (target >= 50 %);
                  and SmolLM2's prefill (a 512- and a 2,000-token prompt; a 64-token tail
                  after 448 cached) -> time and GFLOPS
  QuantMatMul     4-bit weights (asymmetric, block 32) x float rows quantized to int8, vs ONNX
                  Runtime's MatMulNBits (accuracy_level 4) on the same weights and float32
                  MatMul, and the same weights in the default model's GGUF Q4_1 form (a
                  float16 scale and minimum per block for the zero points: gguf_*),
                  SmolLM2's projections, 30 layers' weights per run (as a decode step reads
                  them: past the caches), and its 8-bit LM head (symmetric, block 32,
                  vocab 49,152 x 576, 4 copies per run) -> speedup per product, and its rate
                  against the core's int8 multiply-add roof (bench/int8_roof.cc, built with
                  the system C++ compiler: vpmaddubsw on AVX2, vpdpbusd on AVX-512 VNNI) for
                  the kernels in use (ORT_LORA_QUANT_ISA=avx2 forces our AVX2 ones only;
                  --hide-avx512 makes MLAS take its AVX2 kernels too), the float32 MatMul's
                  against the float32 FMA roof, and the two roofs' ratio (int8_over_f32: what
                  vs_f32 is with both at the same share of their roofs); with the AVX2
                  kernels, the 4-bit rows' rate against their own inner loop run alone on
                  data in L1 (of_q4_loop: what scales, memory and the op around it cost);
                  with --against-library, the same op of another build in turn (vs_library;
                  gguf_vs_library: the default model's form; library_max_diff: how far
                  their outputs are apart, within float rounding or the run stops); the
                  same for PagedAttention's cases

Usage: python bench/bench_ops.py [--quick] [--only SECTION ...] [--cases TEXT ...]
                                [--out results/bench_ops.json]
Prints a table and writes JSON (results, command line, machine). Times are medians over
--reps runs after warm-up; ORT and numpy both use all the cores this process may run on.
"""

from __future__ import annotations

import os
import sys


def _threads_from_argv() -> int:
    """--threads N, else every core this process may run on (read before numpy is imported)."""
    for i, arg in enumerate(sys.argv[:-1]):
        if arg == "--threads":
            return int(sys.argv[i + 1])
    return len(os.sched_getaffinity(0))


THREADS = _threads_from_argv()
# numpy's BLAS reads its thread count at import time (OPENBLAS_CORETYPE is left as it is).
os.environ["OPENBLAS_NUM_THREADS"] = str(THREADS)
os.environ["OMP_NUM_THREADS"] = str(THREADS)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

import ort_lora  # noqa: E402
from ort_lora.adapter_rows import row_elems  # noqa: E402
from ort_lora.bench import hide_avx512  # noqa: E402
from ort_lora.bench.cli import cpu_isa, cpu_name, default_cache_dir  # noqa: E402
from ort_lora.ops.lora_sgmv_ref import (  # noqa: E402
    ADAPTER_DTYPES,
    lora_sgmv,
    place_random_adapters,
)

F32, I32, I64 = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64


def run_times(fn, reps: int, clock, warmup: int = 3) -> tuple[float, float]:
    """(median, min) time of fn() in seconds over `reps` runs after `warmup` untimed ones.

    clock is time.perf_counter (wall) or time.thread_time (this thread's CPU time: with one
    thread, ORT and BLAS both compute on the calling thread, so this ignores time the machine
    spends on other processes). The median is the headline number; the min shows the kernel's
    speed on a busy shared machine and is reported next to the median, never instead of it.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return float(np.median(times)), float(np.min(times))


def paired_times(fns, reps: int, clock, warmup: int = 3) -> list[tuple[float, float]]:
    """(median, min) time of each fn, the fns run in turn within every rep, so a busy phase of
    a shared machine slows them all alike (for ratios between them). Each rep starts one fn
    further on, so every fn takes every place in the turn equally often: a fn run right after
    another finds the caches as that one left them (two kernels on the same weights, timed
    always in one order, favoured the second by 5-10 %). The benchmark programs put the fns'
    sessions on one thread pool first (share_one_pool)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for rep in range(reps):
        for i in range(len(fns)):
            at = (rep + i) % len(fns)
            t0 = clock()
            fns[at]()
            times[at].append(clock() - t0)
    return [(float(np.median(t)), float(np.min(t))) for t in times]


LIBRARY_RTOL = 1e-5  # --against-library: how far apart the two builds' outputs may be


def check_apart(ours: np.ndarray, theirs: np.ndarray, what: str) -> float:
    """How far apart two builds' outputs of the same op on the same inputs are, as a share of
    the largest |ours|; past LIBRARY_RTOL (more than float rounding: other weights, another
    product) the run stops, naming `what`."""
    apart = float(np.abs(ours - theirs).max() / max(np.abs(ours).max(), 1e-30))
    if apart > LIBRARY_RTOL:
        raise SystemExit(
            f"{what}: outputs {apart:.1e} of the largest apart, past float rounding "
            f"({LIBRARY_RTOL:g}): other weights or another product"
        )
    return apart


def one_node_session(op, inputs, outputs, *, library=None, **attrs) -> ort.InferenceSession:
    """inputs/outputs: (name, elem_type, rank); an input named "" is an omitted optional;
    library: another build of the op library to register (library_options), else this one."""
    vis = [helper.make_tensor_value_info(n, t, [None] * r) for n, t, r in inputs if n]
    outs = [helper.make_tensor_value_info(n, t, [None] * r) for n, t, r in outputs]
    node = helper.make_node(
        op, [n for n, _, _ in inputs], [n for n, _, _ in outputs], domain="ort_lora", **attrs
    )
    graph = helper.make_graph([node], op, vis, outs)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(ort_lora.OPS_DOMAIN, 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    opts = library_options(library)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def aligned(a: np.ndarray, align: int = 64) -> np.ndarray:
    """A copy of a starting on an `align`-byte boundary, as ORT allocates the graph's tensors
    (numpy alone gives 16 bytes; misaligned rows cost LoraSGMV 25-40 % in cache)."""
    buf = np.empty(a.nbytes + align, np.uint8)
    skip = -buf.ctypes.data % align
    out = buf[skip : skip + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def bound_runner(sess, feeds, out_name, out):
    """A no-argument callable running sess with inputs and the output bound (no copies)."""
    io = sess.io_binding()
    for name, value in feeds.items():
        io.bind_cpu_input(name, value)
    io.bind_output(out_name, "cpu", 0, out.dtype, out.shape, out.ctypes.data)

    def run():
        sess.run_with_iobinding(io)

    run.buffers = (feeds, out)  # io holds raw pointers: the arrays live as long as the runner
    return run


# ---- LoraSGMV ----------------------------------------------------------------------------------

SGMV_INPUTS = [
    ("y", F32, 2), ("x", F32, 2), ("key_cache", F32, 4), ("value_cache", F32, 4),
    ("seg_starts", I32, 1), ("seg_slots", I32, 1), ("a_offsets", I64, 2), ("b_offsets", I64, 2),
    ("ranks", I32, 2), ("scales", F32, 2),
]  # fmt: skip


def sgmv_feeds(rng, rows, adapters, rank, in_f, out_f, adapter_dtype="float32", layers=1):
    """Equal segments, one per adapter; adapters placed in a pool of (16, 8, 128) pages.
    layers > 1 places adapters * layers adapters: the call for layer l uses slots
    [l * adapters, (l + 1) * adapters), the feeds are layer 0's."""
    placed = place_random_adapters(
        rng,
        [rank] * (adapters * layers),
        in_f,
        out_f,
        (16, 8, 128),
        max_gap=0,
        adapter_dtype=adapter_dtype,
    )
    seg_starts = np.linspace(0, rows, adapters + 1).astype(np.int32)
    return {
        "y": aligned(rng.standard_normal((rows, out_f), dtype=np.float32)),
        "x": aligned(rng.standard_normal((rows, in_f), dtype=np.float32)),
        "key_cache": placed.key_cache,
        "value_cache": placed.value_cache,
        "seg_starts": seg_starts,
        "seg_slots": np.arange(adapters, dtype=np.int32),
        "a_offsets": placed.a_offsets,
        "b_offsets": placed.b_offsets,
        "ranks": np.full((1, adapters * layers), rank, np.int32),
        "scales": rng.uniform(0.5, 2.0, (1, adapters * layers)).astype(np.float32),
    }


def dense_blas_runner(feeds, rank):
    """Per segment x_s @ A_s^T then @ B_s^T with numpy, on weights gathered densely up front."""
    region = np.concatenate([feeds["key_cache"].ravel(), feeds["value_cache"].ravel()])
    in_f, out_f = feeds["x"].shape[1], feeds["y"].shape[1]
    starts, x = feeds["seg_starts"], feeds["x"]
    jobs = []
    for s in range(len(starts) - 1):
        a = aligned(np.stack([region[o : o + in_f] for o in feeds["a_offsets"][s, :rank]]))
        bt = aligned(np.stack([region[o : o + out_f] for o in feeds["b_offsets"][s, :rank]]))
        n = starts[s + 1] - starts[s]
        xs = x[starts[s] : starts[s + 1]]  # [n, in]
        jobs.append(
            (
                xs,
                a.T,
                bt,
                aligned(np.empty((n, rank), np.float32)),
                aligned(np.empty((n, out_f), np.float32)),
            )
        )

    def run():
        for xs, at, bt, v, out in jobs:
            np.matmul(xs, at, out=v)
            np.matmul(v, bt, out=out)

    return run


def bench_sgmv(name, rows, adapters, rank, in_f, out_f, reps, seed, clock):
    rng = np.random.default_rng(seed)
    feeds = sgmv_feeds(rng, rows, adapters, rank, in_f, out_f)
    sess = one_node_session("LoraSGMV", SGMV_INPUTS, [("y_out", F32, 2)], layer=0)
    y_out = aligned(np.empty_like(feeds["y"]))
    run_op = bound_runner(sess, feeds, "y_out", y_out)
    run_op()
    ref = lora_sgmv(**feeds, layer=0)  # a benchmark of a wrong kernel is worth nothing
    np.testing.assert_allclose(y_out, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))
    t_op, t_op_min = run_times(run_op, reps, clock)
    t_blas, t_blas_min = run_times(dense_blas_runner(feeds, rank), reps, clock)
    flops = 2.0 * rows * rank * (in_f + out_f)
    return {
        "case": name, "rows": rows, "adapters": adapters, "rank": rank, "in": in_f, "out": out_f,
        "op_ms": t_op * 1e3, "blas_ms": t_blas * 1e3,
        "op_gflops": flops / t_op / 1e9, "blas_gflops": flops / t_blas / 1e9,
        "ratio": t_blas / t_op,
        "op_min_ms": t_op_min * 1e3, "blas_min_ms": t_blas_min * 1e3,
        "ratio_min": t_blas_min / t_op_min,
    }  # fmt: skip


def sgmv_row_dtype_runner(rows, adapters, rank, in_f, out_f, dtype, seed, layers):
    """A callable making `layers` bound LoraSGMV calls (adapter rows of type `dtype`), each on
    its own adapters in one shared pool: with a pool larger than the caches the rows come from
    memory, as in a model's forward pass. Layer 0's result is checked against the reference."""
    rng = np.random.default_rng(seed)
    feeds = sgmv_feeds(rng, rows, adapters, rank, in_f, out_f, dtype, layers)
    attrs = {} if dtype == "float32" else {"adapter_dtype": ADAPTER_DTYPES[dtype]}
    sess = one_node_session("LoraSGMV", SGMV_INPUTS, [("y_out", F32, 2)], layer=0, **attrs)
    y_out = aligned(np.empty_like(feeds["y"]))
    return layers_runner(sess, feeds, y_out, layers, adapters, ("seg_slots",), dtype)


def layers_runner(sess, feeds, y_out, layers, per_layer, slot_inputs, dtype="float32"):
    """A callable making `layers` bound calls, call i with the inputs slot_inputs shifted by
    i * per_layer slots (its layer's adapters); call 0's result checked against the reference
    (a benchmark of a wrong kernel is worth nothing)."""
    runners = [
        bound_runner(
            sess, feeds | {k: feeds[k] + i * per_layer for k in slot_inputs}, "y_out", y_out
        )  # fmt: skip
        for i in range(layers)
    ]
    runners[0]()
    ref = lora_sgmv(**feeds, layer=0, adapter_dtype=dtype)
    np.testing.assert_allclose(y_out, ref, rtol=1e-4, atol=1e-4 * float(np.abs(ref).max()))

    def run():
        for r in runners:
            r()

    return run


ROW_DTYPES = {"float32": "f32", "bfloat16": "bf16", "int8": "i8"}  # row type -> column prefix


def bench_sgmv_row_dtypes(name, rows, adapters, rank, in_f, out_f, layers, reps, seed, clock):
    """float32 vs bfloat16 and int8 adapter rows, same shapes; times per call; bytes = adapter
    rows read (int8: a scale per row) + x, y, y_out."""
    dtypes = list(ROW_DTYPES)
    runs = [
        sgmv_row_dtype_runner(rows, adapters, rank, in_f, out_f, d, seed, layers) for d in dtypes
    ]
    if layers == 1:  # warm: each alone, so that its rows stay in cache between runs
        timed = [run_times(run, reps, clock) for run in runs]
    else:  # cold: in turn, as a busy machine then slows all alike
        timed = paired_times(runs, max(5, reps // layers), clock, warmup=1)
    act_bytes = 4 * rows * (in_f + 2 * out_f)
    out = {"case": name, "rows": rows, "adapters": adapters, "rank": rank, "in": in_f,
           "out": out_f, "layers": layers}  # fmt: skip
    t32, t32_min = (timed[0][0] / layers, timed[0][1] / layers)
    for d, (median, best) in zip(dtypes, timed):
        t, t_min = median / layers, best / layers
        row_bytes = 4 * adapters * rank * sum(row_elems(n, d) for n in (in_f, out_f))
        if d == "float32":
            out["pool_mb"] = layers * row_bytes / 1e6
        key = ROW_DTYPES[d]
        out |= {f"{key}_ms": t * 1e3, f"{key}_min_ms": t_min * 1e3,
                f"{key}_mb": (row_bytes + act_bytes) / 1e6,
                f"{key}_gbps": (row_bytes + act_bytes) / t / 1e9}  # fmt: skip
        if d != "float32":
            out |= {f"speedup_{key}": t32 / t, f"speedup_{key}_min": t32_min / t_min}
    return out


# ---- LoraSGMV: DoRA and composition -----------------------------------------------------------

MIX_INPUTS = SGMV_INPUTS + [
    ("comp_segs", I32, 1), ("comp_slots", I32, 1), ("comp_weights", F32, 1),
    ("dora_offsets", I64, 1),
]  # fmt: skip
MIXES = ("lora", "dora", "compose2", "lora_2x_rank")


def mix_feeds(rng, rows, adapters, rank, in_f, out_f, mix, layers):
    """Layer 0's feeds of `mix` (14-input node), one segment per adapter:
    lora: each segment one adapter of `rank`; dora: the same adapters, all DoRA;
    compose2: each segment its adapter + a second one of its own (weights 0.6 / 0.4);
    lora_2x_rank: each segment one adapter of 2 * rank (compose2's bytes in one adapter).
    Adapters of all `layers` share one pool (slots_per_layer per layer)."""
    per_layer = adapters * (2 if mix == "compose2" else 1)
    rank_used = 2 * rank if mix == "lora_2x_rank" else rank
    slots = per_layer * layers
    dora = list(range(slots)) if mix == "dora" else []
    placed = place_random_adapters(rng, [rank_used] * slots, in_f, out_f, (16, 8, 128),
                                   max_gap=0, dora_slots=dora)  # fmt: skip
    seg = np.arange(adapters, dtype=np.int32)
    comp = (seg, seg + adapters, np.full(adapters, 0.4, np.float32)) if mix == "compose2" else ()
    return {
        "y": aligned(rng.standard_normal((rows, out_f), dtype=np.float32)),
        "x": aligned(rng.standard_normal((rows, in_f), dtype=np.float32)),
        "key_cache": placed.key_cache,
        "value_cache": placed.value_cache,
        "seg_starts": np.linspace(0, rows, adapters + 1).astype(np.int32),
        "seg_slots": seg,
        "a_offsets": placed.a_offsets,
        "b_offsets": placed.b_offsets,
        "ranks": np.full((1, slots), rank_used, np.int32),
        "scales": np.where(np.arange(slots) % per_layer < adapters, 1.0, 0.6)[None].astype(
            np.float32
        ),
        "comp_segs": comp[0] if comp else np.zeros(0, np.int32),
        "comp_slots": comp[1] if comp else np.zeros(0, np.int32),
        "comp_weights": comp[2] if comp else np.zeros(0, np.float32),
        "dora_offsets": placed.dora_offsets if dora else np.full(slots, -1, np.int64),
    }, per_layer


def mix_runner(rows, adapters, rank, in_f, out_f, mix, seed, layers):
    """A callable making `layers` bound calls of `mix`, each on its own layer's adapters."""
    rng = np.random.default_rng(seed)
    feeds, per_layer = mix_feeds(rng, rows, adapters, rank, in_f, out_f, mix, layers)
    sess = one_node_session("LoraSGMV", MIX_INPUTS, [("y_out", F32, 2)], layer=0)
    y_out = aligned(np.empty_like(feeds["y"]))
    return layers_runner(sess, feeds, y_out, layers, per_layer, ("seg_slots", "comp_slots"))


def bench_sgmv_mixes(name, rows, adapters, rank, in_f, out_f, layers, reps, seed, clock):
    """Every mix, timed in turn within each rep (paired: a busy machine slows them alike);
    times per call; MB = adapter rows read + x, y, y_out."""
    runs = [mix_runner(rows, adapters, rank, in_f, out_f, m, seed, layers) for m in MIXES]
    timed = paired_times(runs, max(5, reps // layers), clock, warmup=1)
    t = {m: (median / layers, best / layers) for m, (median, best) in zip(MIXES, timed)}
    act = 4 * rows * (in_f + 2 * out_f)
    lora_rows = 4 * adapters * rank * (in_f + out_f)
    mb = {"lora": lora_rows + act, "dora": lora_rows + 4 * adapters * out_f + act,
          "compose2": 2 * lora_rows + act, "lora_2x_rank": 2 * lora_rows + act}  # fmt: skip
    row = {"case": name, "rows": rows, "adapters": adapters, "rank": rank, "in": in_f,
           "out": out_f, "layers": layers}  # fmt: skip
    for m in MIXES:
        row[f"{m}_ms"], row[f"{m}_min_ms"], row[f"{m}_mb"] = (
            t[m][0] * 1e3,
            t[m][1] * 1e3,
            mb[m] / 1e6,
        )
    row["dora_vs_lora"] = t["dora"][0] / t["lora"][0]
    row["compose2_vs_lora"] = t["compose2"][0] / t["lora"][0]
    row["compose2_vs_2x_rank"] = t["compose2"][0] / t["lora_2x_rank"][0]
    row["bytes_compose2_vs_lora"] = mb["compose2"] / mb["lora"]
    row["dora_vs_lora_min"] = t["dora"][1] / t["lora"][1]
    row["compose2_vs_lora_min"] = t["compose2"][1] / t["lora"][1]
    return row


def mix_cases(quick: bool):
    """(name, rows, adapters, rank, in, out, layers) on SmolLM2's 576 -> 1536 projection, rank
    16: decode (32 rows, 16 adapters), warm and cold (adapters of many layers, past the LLC),
    and prefill (4 long segments)."""
    cold_mb = 128 if quick else 512
    decode_f32_mb = 16 * 16 * (576 + 1536) * 4 / 1e6
    yield ("decode warm", 32, 16, 16, 576, 1536, 1)
    yield ("decode cold", 32, 16, 16, 576, 1536, int(cold_mb / decode_f32_mb / 2) + 1)
    yield ("prefill warm", 512 if quick else 2048, 4, 16, 576, 1536, 1)


# ---- PagedAttention ----------------------------------------------------------------------------

PA_INPUTS = [
    ("query", F32, 2), ("key", F32, 2), ("value", F32, 2), ("key_cache", F32, 4),
    ("value_cache", F32, 4), ("cumulative_sequence_length", I32, 1), ("past_seqlens", I32, 1),
    ("block_table", I32, 2), ("", F32, 2), ("", F32, 2), ("slot_mapping", I32, 1),
]  # fmt: skip


def pa_inputs(rng, past, new, heads, kv_heads, head_dim, block) -> dict:
    """Sequences with past[b] cached and new[b] new tokens each, blocks shuffled, every cache
    slot random."""
    blocks = [-(-(p + n) // block) for p, n in zip(past, new)]
    table = np.full((len(blocks), max(blocks)), -1, np.int32)
    order = rng.permutation(sum(blocks)).astype(np.int32)
    for b, count in enumerate(blocks):
        table[b, :count] = order[sum(blocks[:b]) : sum(blocks[: b + 1])]
    slots = [table[b, pos // block] * block + pos % block
             for b in range(len(blocks)) for pos in range(past[b], past[b] + new[b])]  # fmt: skip
    tokens, cache_shape = sum(new), (sum(blocks), block, kv_heads, head_dim)
    return {
        "query": rng.standard_normal((tokens, heads * head_dim), dtype=np.float32),
        "key": rng.standard_normal((tokens, kv_heads * head_dim), dtype=np.float32),
        "value": rng.standard_normal((tokens, kv_heads * head_dim), dtype=np.float32),
        "key_cache": rng.standard_normal(cache_shape, dtype=np.float32),
        "value_cache": rng.standard_normal(cache_shape, dtype=np.float32),
        "cumulative_sequence_length": np.cumsum([0, *new]).astype(np.int32),
        "past_seqlens": np.array(past, np.int32),
        "block_table": table,
        "slot_mapping": np.array(slots, np.int32),
    }


def pa_feeds(rng, seqs, context, heads, kv_heads, head_dim, block):
    """Decode: one new token per sequence after context - 1 cached ones."""
    return pa_inputs(rng, [context - 1] * seqs, [1] * seqs, heads, kv_heads, head_dim, block)


def pa_runner(feeds, heads, kv_heads, head_dim, library=None, out=None):
    """A one-node PagedAttention session over `feeds` (on `library`, else this checkout's op
    library), bound to write `out` (default: a buffer of its own), run once: its run
    function."""
    out = np.empty_like(feeds["query"]) if out is None else out
    attrs = dict(num_heads=heads, kv_num_heads=kv_heads, scale=head_dim**-0.5)
    sess = one_node_session(
        "PagedAttention", PA_INPUTS, [("output", F32, 2)], library=library, **attrs
    )
    run_op = bound_runner(sess, feeds, "output", out)
    run_op()
    return run_op


def pa_timed(run_op, out, feeds, heads, kv_heads, head_dim, reps, clock, against=None):
    """(median, min) seconds of `run_op` (this build's PagedAttention on `feeds`, writing
    `out`) and, with `against` (another build's op library), that build's on the same feeds in
    turn (paired_times), after checking the two outputs agree within float rounding:
    {vs_library: its time / this one's, library_max_diff}, else {}."""
    if not against:
        return run_times(run_op, reps, clock), {}
    theirs = np.empty_like(out)
    other = pa_runner(feeds, heads, kv_heads, head_dim, against, out=theirs)
    diff = check_apart(out, theirs, f"PagedAttention ({against})")
    (t_op, t_min), (t_other, _) = paired_times([run_op, other], reps, clock)
    return (t_op, t_min), {"vs_library": t_other / t_op, "library_max_diff": diff}


def bench_paged_attention_prefill(
    past, new, heads, kv_heads, head_dim, block, reps, seed, clock, against=None
):
    """A prefill chunk of one sequence (causal, over its cached past too): time and GFLOPS
    (against: another build's op library, timed in turn: pa_timed)."""
    rng = np.random.default_rng(seed)
    feeds = pa_inputs(rng, [past], [new], heads, kv_heads, head_dim, block)
    out = np.empty_like(feeds["query"])
    run_op = pa_runner(feeds, heads, kv_heads, head_dim, out=out)
    keys = sum(past + t + 1 for t in range(new))  # (query, key) pairs, each scored and summed
    (t_op, t_op_min), extra = pa_timed(
        run_op, out, feeds, heads, kv_heads, head_dim, reps, clock, against
    )
    return {
        "case": f"prefill {new} after {past}", "past": past, "new": new, "heads": heads,
        "kv_heads": kv_heads, "head_dim": head_dim, "block": block,
        "op_ms": t_op * 1e3, "op_gflops": 4 * heads * head_dim * keys / t_op / 1e9,
        "op_min_ms": t_op_min * 1e3, **extra,
    }  # fmt: skip


def bench_paged_attention(
    seqs, context, heads, kv_heads, head_dim, block, reps, seed, clock, against=None
):
    """Returns the result row, or None (with a printed reason) when the kernel is missing
    (against: another build's op library, timed in turn: pa_timed)."""
    rng = np.random.default_rng(seed)
    feeds = pa_feeds(rng, seqs, context, heads, kv_heads, head_dim, block)
    try:
        out = np.empty_like(feeds["query"])
        run_op = pa_runner(feeds, heads, kv_heads, head_dim, out=out)
    except Exception as e:  # the kernel is written in parallel with this benchmark
        print(f"PagedAttention kernel not available: {str(e).splitlines()[0][:160]}")
        return None
    kv_bytes = 2 * seqs * context * kv_heads * head_dim * 4  # K and V read once
    src = np.ones(kv_bytes // 4, np.float32)
    dst = np.empty_like(src)
    (t_op, t_op_min), extra = pa_timed(
        run_op, out, feeds, heads, kv_heads, head_dim, reps, clock, against
    )
    t_copy, t_copy_min = run_times(lambda: np.copyto(dst, src), reps, clock)
    return {
        "case": "decode", "seqs": seqs, "context": context, "heads": heads,
        "kv_heads": kv_heads, "head_dim": head_dim, "block": block, "kv_mb": kv_bytes / 2**20,
        "op_ms": t_op * 1e3, "memcpy_ms": t_copy * 1e3,
        "op_gbps": kv_bytes / t_op / 1e9, "memcpy_gbps": kv_bytes / t_copy / 1e9,
        "ratio": t_copy / t_op,
        "op_min_ms": t_op_min * 1e3, "memcpy_min_ms": t_copy_min * 1e3,
        "ratio_min": t_copy_min / t_op_min, **extra,
    }  # fmt: skip


# ---- driver ------------------------------------------------------------------------------------


# ---- QuantMatMul -----------------------------------------------------------------------------


def quant_session(
    kind: str, k: int, n: int, bits: int, layers: int, rng, library: str | None = None
) -> ort.InferenceSession:
    """`layers` products of x [rows, k] with distinct random [n, k] weights, one node each:
    kind "quant" (ort_lora.QuantMatMul), "nbits" (com.microsoft.MatMulNBits, accuracy_level 4;
    weights as initializers: MLAS quantizes x to int8 only for weights it prepacked), "f32",
    or "gguf": QuantMatMul on the same weights in the default model's form, GGUF Q4_1's (no
    zero points; per block a float16 scale d and minimum m = -zero * d, w = d * code + m, as a
    GGUF file stores them: W as the zero points', d rounded to float16).
    bits 4: asymmetric (zero points), as an int4 export of a float checkpoint; 8: symmetric,
    as the LM head.
    library: the op library's file to register instead of this checkout's."""
    from onnx import numpy_helper

    from ort_lora.export.quant import quantize_rtn, tile_blocks

    nodes, inits = [], []
    for i in range(layers):
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        q = quantize_rtn(w, bits, 32, symmetric=bits == 8)
        if kind == "f32":
            arrays, op, attrs = {"w": w.T.copy()}, "MatMul", {}
        elif kind == "nbits":
            arrays = {"b": q.codes, "s": q.scales, "z": q.packed_zero_points()}
            op, attrs = "MatMulNBits", dict(bits=bits, block_size=32, accuracy_level=4)
            attrs["domain"] = "com.microsoft"
        else:
            if kind == "gguf":
                d = q.scales.astype(np.float16).astype(np.float32)
                m = (-q.zeros.astype(np.float32) * d).astype(np.float16).astype(np.float32)
                q = dataclasses.replace(q, scales=d, zeros=None, offsets=m + np.float32(8) * d)
            t = tile_blocks(q)
            arrays = {"b": t.codes, "s": t.scales, "z": t.zeros, "o": t.offsets}
            op, attrs = "QuantMatMul", dict(bits=bits, block_size=32, domain=ort_lora.OPS_DOMAIN)
        while arrays and list(arrays.values())[-1] is None:  # trailing optional inputs
            arrays.popitem()
        names = [f"{name}{i}" if a is not None else "" for name, a in arrays.items()]
        inits += [numpy_helper.from_array(a, nm) for a, nm in zip(arrays.values(), names) if nm]
        if op != "MatMul":
            attrs |= dict(K=k, N=n)
        nodes.append(helper.make_node(op, ["x", *names], [f"y{i}"], **attrs))
    x = helper.make_tensor_value_info("x", F32, ["rows", k])
    ys = [helper.make_tensor_value_info(f"y{i}", F32, None) for i in range(layers)]
    graph = helper.make_graph(nodes, "quant", [x], ys, inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(ort_lora.OPS_DOMAIN, 1)]
    opsets.append(helper.make_opsetid("com.microsoft", 1))
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    opts = library_options(library)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def library_options(library: str | None = None) -> ort.SessionOptions:
    """Session options with the op library registered (this checkout's, or the build at
    `library`: another build's kernels, to time in turn) and THREADS intra-op threads: the
    process's one pool after share_one_pool, else a pool of the session's own."""
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(library or ort_lora.library_path())
    if _one_pool:
        opts.use_per_session_threads = False
    else:
        opts.intra_op_num_threads = THREADS
    return opts


def share_one_pool(threads: int | None = None) -> None:
    """Puts every session made from here on through library_options or ort_lora's
    session_options (an engine's) on one intra-op pool of `threads` threads (default THREADS;
    ORT's global pool). With a pool per session, the workers of the session run before, still
    spinning, took a core from the one being timed: with 2 threads on 2 cores, the same
    library's LoraSGMV step read 1.14-1.26x apart from itself in turn even after 20 ms of sleep
    between runs; on one pool, 0.99-1.01. ORT then refuses sessions with pools of their own in
    this process, so the benchmark programs call it first thing."""
    global _one_pool
    from onnxruntime.capi import _pybind_state

    _pybind_state.set_global_thread_pool_sizes(THREADS if threads is None else threads, 1)
    _one_pool = True
    plain = ort_lora.session_options

    def pooled(**config):
        config.pop("intra_op_num_threads", None)  # the pool's
        opts = plain(**config)
        opts.use_per_session_threads = False
        return opts

    ort_lora.session_options = pooled


_one_pool = False  # whether share_one_pool has made the process's pool


def quant_cases(quick: bool):
    """(name, rows, k, n, bits, layers or None: the default): SmolLM2's stacked q/k/v, o,
    stacked gate/up and down projections (4 bits), and its 8-bit LM head (4 copies: 113 MB of
    codes, past the caches as in a decode step); one sequence's decode (1 row), 32 sequences'
    (32), a prefill chunk (512)."""
    shapes = [("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576)]
    for rows in (1, 32) if quick else (1, 32, 512):
        for name, k, n in shapes:
            yield (f"{name} x{rows}", rows, k, n, 4, None)
        yield (f"lm_head8 x{rows}", rows, 576, 49152, 8, 4)


def bench_quant(name, rows, k, n, bits, layers, reps, seed, clock, against=None):
    """4 bits: QuantMatMul on the weights in the default model's form too (gguf_*: the same W
    as GGUF Q4_1 blocks, float16 scales and minimums for the zero points). against: another
    op library's file, whose QuantMatMul runs the same weights in turn with this checkout's
    (vs_library: its time / this one's; gguf_vs_library the same for the model's form); their
    outputs must agree within float rounding (LIBRARY_RTOL of the largest |y|: a build that
    sums in another order passes, one reading other weights stops the run), and
    library_max_diff says how far apart they were (0: the same bits)."""
    rng = np.random.default_rng(seed)
    x = {"x": rng.standard_normal((rows, k)).astype(np.float32)}
    kinds = ("quant", "nbits", "f32")
    weights = rng.bit_generator.state  # what the first session draws its weights from

    def first_weights():
        same = np.random.default_rng()
        same.bit_generator.state = weights
        return same

    sessions = [quant_session(kind, k, n, bits, layers, rng) for kind in kinds]
    ours = sessions[0].run(None, x)
    if bits == 4:  # the same W in the offsets form, its products as close as x's rounding allows
        gguf_session = quant_session("gguf", k, n, bits, layers, first_weights())
        for a, b in zip(ours, gguf_session.run(None, x)):
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-2 * np.abs(a).max())
        sessions.append(gguf_session)
    mine = {"quant": sessions[0]} | ({"gguf": sessions[3]} if bits == 4 else {})
    twins = list(mine) if against else []
    apart = 0.0  # the largest difference of the two builds' outputs, of the largest |y|
    for kind in twins:  # the first session's weights, on `against`
        other = quant_session(kind, k, n, bits, layers, first_weights(), against)
        for a, b in zip(mine[kind].run(None, x), other.run(None, x)):
            apart = max(apart, check_apart(a, b, f"{name} ({kind}, {against})"))
        sessions.append(other)
    times = paired_times([lambda s=s: s.run(None, x) for s in sessions], reps, clock)
    (quant, quant_min), (nbits, _), (f32, _) = [(m / layers, lo / layers) for m, lo in times[:3]]
    gguf, extra = {}, {}
    if bits == 4:
        g = times[3][0] / layers
        gguf = {"gguf_ms": g * 1e3, "gguf_vs_nbits": nbits / g, "gguf_vs_f32": f32 / g}
    if twins:
        theirs = {kind: m / layers for kind, (m, _) in zip(twins, times[-len(twins) :])}
        extra = {"vs_library": theirs["quant"] / quant, "library_max_diff": apart}
        if "gguf" in theirs:
            extra["gguf_vs_library"] = theirs["gguf"] / g
    return {
        "case": name,
        "rows": rows,
        "k": k,
        "n": n,
        "bits": bits,
        "layers": layers,
        "quant_ms": quant * 1e3,
        "nbits_ms": nbits * 1e3,
        "f32_ms": f32 * 1e3,
        "vs_nbits": nbits / quant,
        "vs_f32": f32 / quant,
        "quant_gops": 2 * rows * k * n / quant / 1e9,
        "f32_gflops": 2 * rows * k * n / f32 / 1e9,
        "quant_min_ms": quant_min * 1e3,
        **gguf,
        **extra,
    }


def quant_isa() -> str:
    """The QuantMatMul kernels this process runs: the CPU's widest (as --hide-avx512 leaves
    it), capped by ORT_LORA_QUANT_ISA as the op library caps it."""
    flags = hide_avx512.cpu_flags()
    cap = os.environ.get("ORT_LORA_QUANT_ISA", "avx512")
    if cap == "avx512" and {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        return "avx512-vnni"
    return "avx2" if cap in ("avx512", "avx2") and "avx2" in flags else "baseline"


def int8_roof() -> dict:
    """{"avx2_gops", "avx512_vnni_gops", "fma_ymm_gflops", "fma_zmm_gflops",
    "avx2_q4_loop_gops"} of one core (bench/int8_roof.cc, compiled here with $CXX or c++), or
    {"error": why} when it cannot be built or run."""
    import shutil
    import subprocess
    import tempfile

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return {"error": "no C++ compiler ($CXX, c++, g++) to build bench/int8_roof.cc"}
    source = Path(__file__).with_name("int8_roof.cc")
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "int8_roof"
        built = subprocess.run([compiler, "-O2", "-o", str(exe), str(source)], capture_output=True)
        if built.returncode != 0:
            return {"error": f"{compiler} failed on {source.name}: {built.stderr[-300:]!r}"}
        # pinned to one core, as the --threads 1 rows it is compared with
        ran = subprocess.run(["taskset", "-c", "0", str(exe)], capture_output=True, text=True)
        if ran.returncode != 0:
            ran = subprocess.run([str(exe)], capture_output=True, text=True)
        try:
            return json.loads(ran.stdout)
        except json.JSONDecodeError:
            return {"error": f"int8_roof printed {ran.stdout[-200:]!r}"}


def machine_info() -> dict:
    return {
        "cpu": cpu_name(), "isa": cpu_isa(), "threads": THREADS, "quant_isa": quant_isa(),
        "load_average_after": os.getloadavg(), "python": platform.python_version(),
        "onnxruntime": ort.__version__, "numpy": np.__version__,
        "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
    }  # fmt: skip


def sgmv_cases(quick: bool):
    """(name, rows, adapters, rank, in, out): decode = 1 row per adapter, prefill = long ones."""
    for in_f, out_f in [(576, 1536), (4096, 4096)]:
        yield (f"decode {in_f}->{out_f}", 32, 32, 16, in_f, out_f)
        yield (f"prefill {in_f}->{out_f}", 512 if quick else 2048, 4, 16, in_f, out_f)


def row_dtype_cases(quick: bool):
    """(name, rows, adapters, rank, in, out, layers): SmolLM2's 576 -> 1536 projection, decode
    with 32 rows over 16 adapters (every segment a distinct adapter), prefill with long
    segments. "warm": one call repeated, its rows stay in cache; "cold": a different layer's
    adapters each call, float32 rows of all layers about 512 MB (128 MB --quick), past the LLC."""
    cold_mb = 128 if quick else 512
    decode_f32_mb = 16 * 16 * (576 + 1536) * 4 / 1e6
    yield ("decode warm", 32, 16, 16, 576, 1536, 1)
    yield ("decode cold", 32, 16, 16, 576, 1536, int(cold_mb / decode_f32_mb) + 1)
    yield ("prefill warm", 512 if quick else 2048, 4, 16, 576, 1536, 1)


def print_table(title, rows, cols):
    """First column left-aligned and wide (case names), the rest numbers."""

    def cell(i, v):
        if i == 0:
            return f"{v!s:<20s}"
        return f"{v:>11.3f}" if isinstance(v, float) else f"{v!s:>11s}"

    if not rows:  # a section not run (--only)
        return
    print(f"\n{title}")
    print("  ".join(cell(i, c) for i, c in enumerate(cols)))
    for r in rows:
        print("  ".join(cell(i, r.get(c)) for i, c in enumerate(cols)))  # absent: None


SECTIONS = ("sgmv", "rows", "mixes", "attention", "quant")


def save_result(out: str | Path, fields: dict, load_before=None) -> None:
    """The benchmark's JSON at `out` (its folder made): the command that ran it, the machine
    (with the load average before the run, when given), then fields; and a line saying where."""
    machine = machine_info()
    if load_before is not None:
        machine["load_average_before"] = load_before
    result = {"command": " ".join([sys.executable, *sys.argv]), "machine": machine, **fields}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller shapes, fewer repetitions")
    parser.add_argument("--reps", type=int, default=None, help="timed runs per case (median)")
    parser.add_argument("--threads", type=int, default=THREADS, help="ORT and BLAS threads")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with the calling thread's CPU clock (needs --threads 1; for a shared machine)",
    )
    parser.add_argument("--out", default="results/bench_ops.json", help="JSON output path")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SECTIONS,
        default=list(SECTIONS),
        help="run these sections only (default: all)",
    )
    parser.add_argument(
        "--cases",
        nargs="+",
        metavar="TEXT",
        help="run only the cases whose name contains one of these (e.g. lm_head8 'qkv x1')",
    )
    parser.add_argument(
        "--hide-avx512",
        action="store_true",
        help="run as on an AVX2-only CPU: MLAS and the op library both take their AVX2 kernels "
        "(ort_lora/bench/hide_avx512.py)",
    )
    parser.add_argument(
        "--against-library",
        metavar="SO",
        help="also time QuantMatMul and PagedAttention of this op library file (a build of "
        "another commit) on the same inputs, in turn with this checkout's: vs_library = its "
        "time / this one's",
    )
    args = parser.parse_args(argv)
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time measures the calling thread only: use it with --threads 1")
    if args.hide_avx512:
        hide_avx512.rerun_hidden(Path(default_cache_dir()))
    share_one_pool()
    clock = time.thread_time if args.cpu_time else time.perf_counter
    load_before = os.getloadavg()
    reps = args.reps or (5 if args.quick else 20)
    only = set(args.only)
    cases = list(sgmv_cases(args.quick)) if "sgmv" in only else []
    dtype_cases = list(row_dtype_cases(args.quick)) if "rows" in only else []
    mixes = list(mix_cases(args.quick)) if "mixes" in only else []
    qcases = list(quant_cases(args.quick)) if "quant" in only else []
    if args.cases:
        cases, dtype_cases, mixes, qcases = (
            [c for c in group if any(text in c[0] for text in args.cases)]
            for group in (cases, dtype_cases, mixes, qcases)
        )
    total = len(cases) + len(dtype_cases) + len(mixes) + len(qcases) + 1
    sgmv = []
    for i, case in enumerate(cases):
        print(f"[{i + 1}/{total}] LoraSGMV {case[0]} ...", flush=True)
        sgmv.append(bench_sgmv(*case, reps=reps, seed=i, clock=clock))
    row_dtypes = []
    for i, case in enumerate(dtype_cases):
        done = len(cases) + i + 1
        print(f"[{done}/{total}] LoraSGMV rows f32/bf16/int8 {case[0]} ...", flush=True)
        row_dtypes.append(bench_sgmv_row_dtypes(*case, reps=reps, seed=50 + i, clock=clock))
    mix_rows = []
    for i, case in enumerate(mixes):
        done = len(cases) + len(dtype_cases) + i + 1
        print(f"[{done}/{total}] LoraSGMV DoRA / composition {case[0]} ...", flush=True)
        mix_rows.append(bench_sgmv_mixes(*case, reps=reps, seed=70 + i, clock=clock))
    quant_rows = []
    for i, case in enumerate(qcases):
        done = len(cases) + len(dtype_cases) + len(mixes) + i + 1
        print(f"[{done}/{total}] QuantMatMul / MatMulNBits / MatMul {case[0]} ...", flush=True)
        *shape, layers = case
        layers = layers or (10 if args.quick else 30)
        quant_rows.append(
            bench_quant(*shape, layers, reps, 90 + i, clock, against=args.against_library)
        )
    roof = int8_roof() if quant_rows else {}
    roof_gops = roof.get("avx512_vnni_gops" if quant_isa() == "avx512-vnni" else "avx2_gops")
    # float32 MatMul runs MLAS's AVX-512 kernels where the CPU shows AVX-512F, else its FMA3 ones
    f32_roof = roof.get("fma_zmm_gflops") or roof.get("fma_ymm_gflops")
    if roof_gops and f32_roof:  # the most vs_f32 can be with both ops at the same share of roof
        roof["int8_over_f32"] = round(roof_gops / f32_roof, 2)
    # the AVX2 4-bit kernels' own loop, data in L1 and no float scaling: their ceiling
    loop_gops = roof.get("avx2_q4_loop_gops") if quant_isa() == "avx2" else None
    for row in quant_rows:  # per core: the roofs are one core's
        row["of_roof"] = row["quant_gops"] / THREADS / roof_gops if roof_gops else None
        row["f32_of_roof"] = row["f32_gflops"] / THREADS / f32_roof if f32_roof else None
        of_loop = loop_gops and row["bits"] == 4
        row["of_q4_loop"] = row["quant_gops"] / THREADS / loop_gops if of_loop else None
    pa, pa_prefill = None, []
    if "attention" in only:
        print(f"[{total}/{total}] PagedAttention decode ...", flush=True)
        seqs = 8 if args.quick else 32
        against = args.against_library
        pa = bench_paged_attention(seqs, 1024, 32, 8, 128, 16, reps, 99, clock, against)
        if pa is not None:  # SmolLM2's attention (9 / 3 heads of 64): prompts, a prompt's tail
            chunks = [(0, 256), (192, 64)] if args.quick else [(0, 512), (0, 2000), (448, 64)]
            pa_prefill = [
                bench_paged_attention_prefill(past, new, 9, 3, 64, 16, reps, 98, clock, against)
                for past, new in chunks
            ]
    cols = ["case", "rows", "op_ms", "blas_ms", "op_gflops", "blas_gflops", "ratio", "ratio_min"]
    title = "LoraSGMV vs numpy BLAS, same FLOPs (ratio = BLAS time / op time; medians)"
    print_table(title, sgmv, cols)
    cols = ["case", "rows", "layers", "f32_ms", "bf16_ms", "i8_ms", "speedup_bf16", "speedup_i8"]
    cols += ["speedup_i8_min", "f32_mb", "bf16_mb", "i8_mb", "f32_gbps", "i8_gbps"]
    title = "LoraSGMV 576->1536 rank 16, adapter rows float32 vs bfloat16 and int8 (per call; MB ="
    title += " adapter rows + x, y, y_out)"
    print_table(title, row_dtypes, cols)
    cols = ["case", "rows", "layers", "lora_ms", "dora_ms", "dora_vs_lora", "dora_vs_lora_min"]
    cols += ["compose2_ms", "lora_2x_rank_ms", "compose2_vs_lora", "compose2_vs_2x_rank"]
    cols += ["bytes_compose2_vs_lora"]
    title = "LoraSGMV 576->1536 rank 16: DoRA vs plain LoRA, 2 composed adapters vs 1 and vs one"
    title += " of rank 32 (per call; ratios of medians)"
    print_table(title, mix_rows, cols)
    cols = ["case", "rows", "k", "n", "bits", "quant_ms", "nbits_ms", "f32_ms", "vs_nbits"]
    cols += ["vs_f32", "gguf_ms", "gguf_vs_nbits", "gguf_vs_f32", "quant_gops", "of_roof"]
    cols += ["f32_gflops", "f32_of_roof"]
    cols += ["of_q4_loop"] if loop_gops else []
    cols += ["vs_library", "gguf_vs_library"] if args.against_library else []
    title = "QuantMatMul vs MatMulNBits (accuracy_level 4) and float32 MatMul, block 32"
    title += f" ({quant_isa()} kernels; per product, medians of paired runs; vs_* = their time"
    title += " / QuantMatMul's; gguf_* = QuantMatMul on the same weights in the default model's"
    title += " GGUF Q4_1 form, offsets for zero points; of_roof = GOPS per thread / the int8"
    title += " roof, f32_of_roof = float32"
    title += " MatMul's GFLOPS per thread / the float32 FMA roof, of_q4_loop = GOPS per thread /"
    title += f" the AVX2 4-bit kernel's loop alone: {roof})"
    print_table(title, quant_rows, cols)
    if pa is not None:
        other = ["vs_library"] if args.against_library else []
        cols = ["case", "seqs", "context", "kv_mb", "op_ms", "memcpy_ms", "op_gbps", "ratio"]
        cols += ["ratio_min", *other]
        print_table("PagedAttention vs np.copyto of K+V (ratio = copy time / op time)", [pa], cols)
        cols = ["case", "heads", "head_dim", "op_ms", "op_gflops", "op_min_ms", *other]
        print_table("PagedAttention prefill (one sequence, causal)", pa_prefill, cols)
    result = {
        "clock": "thread_cpu" if args.cpu_time else "wall",
        "reps": reps,
        "lora_sgmv": sgmv,
        "lora_sgmv_row_dtypes": row_dtypes,
        "lora_sgmv_dora_composition": mix_rows,
        "quant_matmul": quant_rows,
        "int8_roof": roof,
        "against_library": args.against_library,
        "paged_attention": pa if pa is not None else "PagedAttention kernel not available",
        "paged_attention_prefill": pa_prefill,
    }
    save_result(args.out, result, load_before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
