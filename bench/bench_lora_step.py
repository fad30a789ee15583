"""LoraSGMV over one decode step of SmolLM2-135M: every layer's calls, against memory bandwidth.

One ONNX graph holds the LoraSGMV calls of a decode step (30 layers x 7 modules, SmolLM2's
shapes; each layer its own pool share, the adapters' rows at the same offsets in every layer as
the engine places them), 32 rows over 16 adapters of rank 16 (request i on adapter i % 16;
--rows 1: one request decoding with one adapter, where the op's fixed cost per call shows;
--adapters N: the rows over the first N adapters, as many rows on each, so that each adapter's
rows serve more requests, as a popular adapter's do):

  separate   one node per module (7 a layer), as exports before modules sharing x did
  fused      q/k/v in one node and gate/up in one (attribute modules: 4 nodes a layer)
  *_base     the same nodes, every row without an adapter (one segment, slot -1): the op's
             fixed cost
  cached     (--cached) fused, every layer reading layer 0's rows (one layer's pool share:
             11 MB of float32 rows, inside a server CPU's L3): how fast the kernel is when
             memory is not what bounds it
  other      (--against-library SO) fused, run by another build of the op library: a kernel
             change timed in turn with the build it changes (vs_library: its time / this one's)

for each adapter row type (float32, bfloat16, float16, int8). Per step: the time (median of
paired runs, the variants in turn), the adapter rows' bytes read and their rate (GB/s), that
rate over the machine's read bandwidth (numpy sums of a 512 MB buffer split over as many
threads: the rows are only read, so 1.0 is as fast as memory goes), and the time reading the
rows alone takes at that bandwidth (floor_ms: no kernel of this op can be faster).

Usage: python bench/bench_lora_step.py [--threads N] [--reps 20] [--rows 32] [--adapters 16]
       [--dtypes float32,int8]
       [--layouts separate,fused] [--cached] [--against-library SO]
       [--out results/bench_lora_step.json]
"""

from __future__ import annotations

import os
import sys

# bench_ops sets the BLAS thread count before numpy is imported
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ops import (  # noqa: E402, I001
    THREADS,
    aligned,
    library_options,
    paired_times,
    save_result,
    share_one_pool,
)

import argparse  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

import ort_lora  # noqa: E402
from ort_lora.adapter_rows import row_elems  # noqa: E402
from ort_lora.ops.lora_sgmv_ref import ADAPTER_DTYPES, lora_sgmv, place_random_adapters  # noqa: E402

F32, I32, I64 = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64
LAYERS, ROWS, ADAPTERS, RANK = 30, 32, 16, 16  # ROWS: --rows's default
HIDDEN, INTER = 576, 1536
# module -> (in, out); the groups that read one x
MODULES = {
    "q": (576, 576),
    "k": (576, 192),
    "v": (576, 192),
    "o": (576, 576),
    "gate": (576, 1536),
    "up": (576, 1536),
    "down": (1536, 576),
}
GROUPS = {
    "separate": [[m] for m in MODULES],
    "fused": [["q", "k", "v"], ["o"], ["gate", "up"], ["down"]],
}
TABLES = ("a_offsets", "b_offsets", "ranks", "scales", "dora_offsets")


def place(rng, dtype):
    """One layer's pool share with every module's rows (the modules' pools concatenated
    page-wise, offsets moved), and each module's (a_offsets, b_offsets)."""
    placed = {
        m: place_random_adapters(
            rng, [RANK] * ADAPTERS, i, o, (16, 3, 64), max_gap=0, adapter_dtype=dtype
        )
        for m, (i, o) in MODULES.items()
    }
    halves = {m: p.key_cache.size for m, p in placed.items()}
    total, before, offsets = sum(halves.values()), 0, {}
    for m, p in placed.items():
        moved = []
        for table in (p.a_offsets, p.b_offsets):
            out = table.copy()
            out[(table >= 0) & (table < halves[m])] += before
            out[table >= halves[m]] += total - halves[m] + before
            moved.append(out)
        offsets[m] = moved
        before += halves[m]
    key = np.concatenate([p.key_cache for p in placed.values()])
    value = np.concatenate([p.value_cache for p in placed.values()])
    return key, value, offsets


def step_model(groups, dtype, layers: int, rows: int) -> bytes:
    """A graph of `layers` layers of LoraSGMV nodes (groups of modules sharing a node) over
    `rows` rows, each module's y chained from layer to layer (so ORT runs every node in place)."""
    vi = helper.make_tensor_value_info
    inputs = [
        vi("x_h", F32, [rows, HIDDEN]),
        vi("x_i", F32, [rows, INTER]),
        vi("seg_starts", I32, [None]),
        vi("seg_slots", I32, [None]),
        vi("comp_segs", I32, [0]),
        vi("comp_slots", I32, [0]),
        vi("comp_weights", F32, [0]),
    ]
    for m, (_, out) in MODULES.items():
        inputs.append(vi(f"y_{m}", F32, [rows, out]))
        inputs += [
            vi(f"{t}_{m}", t_type, [None] * rank)
            for t, t_type, rank in zip(TABLES, (I64, I64, I32, F32, I64), (2, 2, 2, 2, 1))
        ]
    attrs = {} if dtype == "float32" else {"adapter_dtype": ADAPTER_DTYPES[dtype]}
    nodes, last = [], {m: f"y_{m}" for m in MODULES}
    for layer in range(layers):
        inputs += [
            vi(f"key_cache.{layer}", F32, [None] * 4),
            vi(f"value_cache.{layer}", F32, [None] * 4),
        ]
        for group in groups:
            first = group[0]
            names = [
                last[first],
                "x_i" if first == "down" else "x_h",
                f"key_cache.{layer}",
                f"value_cache.{layer}",
                "seg_starts",
                "seg_slots",
                *(f"{t}_{first}" for t in TABLES[:4]),
                "comp_segs",
                "comp_slots",
                "comp_weights",
                f"dora_offsets_{first}",
            ]
            for m in group[1:]:
                names += [last[m], *(f"{t}_{m}" for t in TABLES)]
            outs = [f"y_{m}.{layer}" for m in group]
            extra = {"modules": len(group)} if len(group) > 1 else {}
            nodes.append(
                helper.make_node(
                    "LoraSGMV",
                    names,
                    outs,
                    domain=ort_lora.OPS_DOMAIN,
                    layer=layer,
                    **attrs,
                    **extra,
                )
            )
            last.update(zip(group, outs))
    outputs = [vi(last[m], F32, [rows, MODULES[m][1]]) for m in MODULES]
    graph = helper.make_graph(nodes, "lora_step", inputs, outputs)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(ort_lora.OPS_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10).SerializeToString()


def step_feeds(rng, dtype, rows: int, adapters: int = ADAPTERS) -> dict:
    """The step's inputs: `rows` rows over the first `adapters` adapters (of the 16 placed), in
    segments by adapter of equal length (32 rows over 16: 16 segments of 2; 1 row: one segment
    on adapter 0)."""
    key, value, offsets = place(rng, dtype)
    used = min(rows, adapters)
    feeds = {
        "x_h": aligned(rng.standard_normal((rows, HIDDEN), dtype=np.float32)),
        "x_i": aligned(rng.standard_normal((rows, INTER), dtype=np.float32)),
        "seg_starts": np.linspace(0, rows, used + 1).astype(np.int32),
        "seg_slots": np.arange(used, dtype=np.int32),
        "comp_segs": np.zeros(0, np.int32),
        "comp_slots": np.zeros(0, np.int32),
        "comp_weights": np.zeros(0, np.float32),
    }
    for m, (_, out) in MODULES.items():
        feeds[f"y_{m}"] = aligned(rng.standard_normal((rows, out), dtype=np.float32))
        feeds[f"a_offsets_{m}"], feeds[f"b_offsets_{m}"] = offsets[m]
        feeds[f"ranks_{m}"] = np.full((LAYERS, ADAPTERS), RANK, np.int32)
        feeds[f"scales_{m}"] = rng.uniform(0.5, 2.0, (LAYERS, ADAPTERS)).astype(np.float32)
        feeds[f"dora_offsets_{m}"] = np.zeros(0, np.int64)
    for layer in range(LAYERS):  # each layer its own rows (memory), at the same offsets
        feeds[f"key_cache.{layer}"] = aligned(key)
        feeds[f"value_cache.{layer}"] = aligned(value)
    return feeds


def session(groups, dtype, rows: int, layers: int | None = None, library=None):
    """The step's graph over `layers` layers (None: LAYERS) as an ORT session; library: another
    build of the op library (bench_ops.library_options), else this one."""
    model = step_model(groups, dtype, LAYERS if layers is None else layers, rows)
    opts = library_options(library)
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def check_one_layer(groups, dtype, feeds, library=None) -> None:
    """Layer 0 alone, every module's output against the reference (a benchmark of a wrong
    kernel is worth nothing)."""
    sess = session(groups, dtype, len(feeds["x_h"]), layers=1, library=library)
    names = {i.name for i in sess.get_inputs()}
    got = sess.run(None, {k: v for k, v in feeds.items() if k in names})
    for m, out in zip(MODULES, got, strict=True):
        tables = {t: feeds[f"{t}_{m}"] for t in TABLES}
        x = feeds["x_i" if m == "down" else "x_h"]
        ref = lora_sgmv(
            feeds[f"y_{m}"],
            x,
            feeds["key_cache.0"],
            feeds["value_cache.0"],
            feeds["seg_starts"],
            feeds["seg_slots"],
            **tables,
            layer=0,
            adapter_dtype=dtype,
        )
        scale = float(np.abs(ref).max())
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * scale, err_msg=m)


def step_runner(groups, dtype, feeds, library=None):
    """A callable running the step's graph with its inputs bound (no copies)."""
    sess = session(groups, dtype, len(feeds["x_h"]), library=library)
    io = sess.io_binding()
    for name, value in feeds.items():
        io.bind_cpu_input(name, value)
    for out in sess.get_outputs():
        io.bind_output(out.name, "cpu")

    def run():
        sess.run_with_iobinding(io)

    run.buffers = feeds  # io holds raw pointers: the arrays live as long as the runner
    return run


def read_bandwidth(threads: int, mb: int = 512, reps: int = 5) -> float:
    """GB/s of numpy sums of an mb MB buffer split over `threads` threads (numpy releases the
    GIL while it sums; a sum streams its input once, as LoraSGMV streams adapter rows)."""
    buf = np.ones(mb * 2**20 // 4, np.float32)
    parts = np.array_split(buf, threads)

    def read():
        workers = [threading.Thread(target=np.sum, args=(part,)) for part in parts]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    read()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        read()
        times.append(time.perf_counter() - t0)
    return buf.nbytes / float(np.median(times)) / 1e9


def row_bytes_per_step(dtype: str, adapters: int) -> int:
    """Adapter-row bytes one decode step over `adapters` adapters reads: their A and B^T rows of
    every module and layer (int8: each row's scale too)."""
    per_adapter = sum(row_elems(i, dtype) + row_elems(o, dtype) for i, o in MODULES.values())
    return 4 * per_adapter * RANK * adapters * LAYERS


def bench_dtype(
    dtype: str,
    rows: int,
    reps: int,
    seed: int,
    layouts: list[str],
    cached: bool,
    against=None,
    adapters: int = ADAPTERS,
) -> dict:
    """For each layout (GROUPS: separate, fused), the step without adapters (base) and with
    them (the rows over `adapters` adapters), with `cached` the fused step on one layer's rows,
    and with `against` (another build of the op library) that build's fused step, all in turn
    within every rep."""
    rng = np.random.default_rng(seed)
    mixed = step_feeds(rng, dtype, rows, adapters)
    # every row without an adapter: one segment of slot -1
    base = mixed | {
        "seg_starts": np.array([0, rows], np.int32),
        "seg_slots": np.full(1, -1, np.int32),
    }
    runs = {}
    for layout in layouts:
        check_one_layer(GROUPS[layout], dtype, mixed)
        runs[f"{layout}_base"] = step_runner(GROUPS[layout], dtype, base)
        runs[layout] = step_runner(GROUPS[layout], dtype, mixed)
    if cached:
        one = {f"{c}.{layer}": mixed[f"{c}.0"] for c in ("key_cache", "value_cache")
               for layer in range(LAYERS)}  # fmt: skip
        runs["cached"] = step_runner(GROUPS["fused"], dtype, mixed | one)
    if against:
        check_one_layer(GROUPS["fused"], dtype, mixed, library=against)
        runs["other"] = step_runner(GROUPS["fused"], dtype, mixed, library=against)
    times = paired_times(list(runs.values()), reps, time.perf_counter, warmup=2)
    used = len(mixed["seg_slots"])  # a segment per adapter the rows use
    row_bytes = row_bytes_per_step(dtype, used)
    row = {"dtype": dtype, "adapters": used, "row_mb": row_bytes / 1e6}
    for kind, (median, best) in zip(runs, times, strict=True):
        row |= {f"{kind}_ms": median * 1e3, f"{kind}_min_ms": best * 1e3}
    for layout in layouts + ["cached"] * cached:
        row[f"{layout}_gbps"] = row_bytes / (row[f"{layout}_ms"] / 1e3) / 1e9
    if len(layouts) == 2:
        row["fused_vs_separate"] = row["separate_ms"] / row["fused_ms"]
    if against:  # above 1: this build's fused step is the faster
        row["vs_library"] = row["other_ms"] / row["fused_ms"]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=THREADS, help="ORT threads (and reads)")
    parser.add_argument("--reps", type=int, default=20, help="timed steps per variant (median)")
    parser.add_argument(
        "--rows",
        type=int,
        default=ROWS,
        help="rows of the step (request i on adapter i %% 16; 1: one request on one adapter)",
    )
    parser.add_argument(
        "--adapters",
        type=int,
        default=ADAPTERS,
        help=f"the rows over this many adapters, 1 to {ADAPTERS} (as many rows on each)",
    )
    parser.add_argument(
        "--dtypes", default="float32,bfloat16,float16,int8", help="adapter row types"
    )
    parser.add_argument(
        "--layouts",
        default="separate,fused",
        help="node layouts: separate (one node per module) and fused (modules sharing x in one "
        "node; a library from before attribute modules runs separate only)",
    )
    parser.add_argument(
        "--cached",
        action="store_true",
        help="also the fused step with every layer on layer 0's rows (in cache: the kernel alone)",
    )
    parser.add_argument(
        "--against-library",
        metavar="SO",
        help="also another build's op library (its fused step, in turn with this one's): "
        "vs_library = its time / this build's",
    )
    parser.add_argument("--out", default="results/bench_lora_step.json", help="JSON output path")
    args = parser.parse_args(argv)
    if not 1 <= args.adapters <= ADAPTERS:
        parser.error(f"--adapters: 1 to {ADAPTERS}, got {args.adapters}")
    if args.against_library and "fused" not in args.layouts.split(","):
        parser.error("--against-library compares fused steps: keep fused in --layouts")
    share_one_pool()
    load_before = os.getloadavg()
    bandwidth = read_bandwidth(args.threads)
    layouts = args.layouts.split(",")
    rows = []
    for i, dtype in enumerate(args.dtypes.split(",")):
        print(f"[{i + 1}] LoraSGMV decode step, {dtype} rows ...", flush=True)
        rows.append(
            bench_dtype(
                dtype,
                args.rows,
                args.reps,
                i,
                layouts,
                args.cached,
                args.against_library,
                args.adapters,
            )
        )
        rows[-1]["floor_ms"] = rows[-1]["row_mb"] / bandwidth
        for layout in layouts:
            rows[-1][f"{layout}_vs_read"] = rows[-1][f"{layout}_gbps"] / bandwidth
    cols = ["dtype", "row_mb", "floor_ms"]
    for layout in layouts:
        cols += [f"{layout}_base_ms", f"{layout}_ms", f"{layout}_gbps", f"{layout}_vs_read"]
    cols += ["fused_vs_separate"] if len(layouts) == 2 else []
    cols += ["cached_ms", "cached_gbps"] if args.cached else []
    cols += ["other_ms", "vs_library"] if args.against_library else []
    print(
        f"\nLoraSGMV, one SmolLM2 decode step ({LAYERS} layers, {args.rows} rows, "
        f"{rows[0]['adapters']} adapters of rank {RANK}); read bandwidth {bandwidth:.1f} GB/s"
    )
    width = max(len(c) for c in cols)
    print("  ".join(f"{c:>{width}s}" for c in cols))
    for r in rows:
        cells = [f"{r[c]:>{width}.3f}" if isinstance(r[c], float) else f"{r[c]:>{width}s}"
                 for c in cols]  # fmt: skip
        print("  ".join(cells))
    fields = {
        "read_gbps": bandwidth,
        "step_rows": args.rows,
        "rows": rows,
        "against_library": args.against_library,
    }
    save_result(args.out, fields, load_before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
