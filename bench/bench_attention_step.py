"""PagedAttention over one decode step of SmolLM2-135M: its 30 layers' calls, against memory.

Each layer is one PagedAttention session on a cache of its own (9 query heads, 3 kv heads of
64, blocks of 16 rows), as the engine's 30 layers are, so that a step's keys and values come
from memory as they do in the engine; and the same 30 calls on layer 0's cache (in cache: the
kernel alone). Cases: one request at a long context (the step that grows with a chat's
length), and many requests at a short one. Per case: the step's time (median of paired runs,
the variants in turn) and the rate at which it reads the keys and values (GB/s). With
--against-library the same sessions of another build of the op library run in turn with this
checkout's (vs_library: its time over this one's).

Usage: python bench/bench_attention_step.py [--threads 2] [--reps 15] [--cases 1x2000,32x256]
       [--against-library SO] [--out results/bench_attention_step.json]
"""

from __future__ import annotations

import os
import sys

# bench_ops sets the BLAS thread count before numpy is imported
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ops import (  # noqa: E402, I001
    THREADS,
    pa_feeds,
    pa_runner,
    paired_times,
    save_result,
    share_one_pool,
)

import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402


LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
CASES = "1x2000,1x500,32x256"  # requests x context


def layer_runners(layers: list[dict], library: str | None) -> list:
    """One bound PagedAttention run per layer's feeds, on `library` (None: this checkout's)."""
    return [pa_runner(feeds, HEADS, KV_HEADS, HEAD_DIM, library) for feeds in layers]


def step(runs: list, cached: bool):
    """A decode step: every layer's call, or (cached) layer 0's call as many times."""

    def run():
        for r in [runs[0]] * len(runs) if cached else runs:
            r()

    return run


def bench_case(seqs: int, context: int, reps: int, against: str | None) -> dict:
    layers = [pa_feeds(np.random.default_rng(99 + i), seqs, context, HEADS, KV_HEADS, HEAD_DIM,
                       BLOCK) for i in range(LAYERS)]  # fmt: skip
    variants = {"memory": step(layer_runners(layers, None), False)}
    variants["cached"] = step(layer_runners(layers, None), True)
    if against:
        variants["other"] = step(layer_runners(layers, against), False)
    times = paired_times(list(variants.values()), reps, time.perf_counter, warmup=2)
    kv_bytes = LAYERS * 2 * seqs * context * KV_HEADS * HEAD_DIM * 4  # K and V, read once
    row = {"case": f"{seqs}x{context}", "seqs": seqs, "context": context, "kv_mb": kv_bytes / 1e6}
    for name, (median, best) in zip(variants, times, strict=True):
        row |= {f"{name}_ms": median * 1e3, f"{name}_min_ms": best * 1e3,
                f"{name}_gbps": kv_bytes / median / 1e9}  # fmt: skip
    if against:  # above 1: this build's step is the faster
        row["vs_library"] = row["other_ms"] / row["memory_ms"]
    return row


def parse_cases(text: str) -> list[tuple[int, int]]:
    cases = []
    for case in text.split(","):
        seqs, _, context = case.partition("x")
        if not (seqs.isdigit() and context.isdigit() and int(seqs) > 0 and int(context) > 0):
            raise ValueError(f"a case is REQUESTSxCONTEXT, e.g. 1x2000; got {case!r}")
        cases.append((int(seqs), int(context)))
    return cases


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=THREADS, help="ORT threads")
    parser.add_argument("--reps", type=int, default=15, help="timed steps per variant (median)")
    parser.add_argument("--cases", default=CASES, help="requests x context, comma-separated")
    parser.add_argument(
        "--against-library",
        metavar="SO",
        help="also another build's op library, in turn with this one's: vs_library = its "
        "time / this build's",
    )
    parser.add_argument("--out", default="results/bench_attention_step.json")
    args = parser.parse_args(argv)
    try:
        cases = parse_cases(args.cases)
    except ValueError as e:
        parser.error(f"--cases: {e}")
    if args.against_library and not os.path.isfile(args.against_library):
        parser.error(f"--against-library: no such file {args.against_library!r}")
    share_one_pool(args.threads)
    load_before = os.getloadavg()
    rows = []
    for i, (seqs, context) in enumerate(cases):
        print(f"[{i + 1}/{len(cases)}] {seqs} x {context} ...", flush=True)
        rows.append(bench_case(seqs, context, args.reps, args.against_library))
    cols = ["case", "kv_mb", "memory_ms", "memory_gbps", "cached_ms", "cached_gbps"]
    cols += ["other_ms", "vs_library"] if args.against_library else []
    print(f"\nPagedAttention, one SmolLM2 decode step ({LAYERS} layers, {HEADS} / {KV_HEADS} heads "
          f"of {HEAD_DIM}), {args.threads} threads")  # fmt: skip
    print("  ".join(f"{c:>12s}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>12.3f}" if isinstance(r[c], float) else f"{r[c]:>12}"
                        for c in cols))  # fmt: skip
    fields = {"threads": args.threads, "rows": rows, "against_library": args.against_library}
    save_result(args.out, fields, load_before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
