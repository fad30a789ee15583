"""DoRA vs plain LoRA and 2 composed adapters vs 1, in one engine each, in steady state.

`ort-lora bench --experiments variants` times each row once, in a fresh engine, from the first
step: the adapters' first pool loads are in its time, and on a shared machine its rows, minutes
apart, see different loads. This program keeps one engine per kind and runs the same workload
(32 requests over 16 adapters, 8 prompt + 64 new tokens, greedy, EOS ignored) `--reps` times:
pass 0 loads the adapters into the pool, the later passes are the steady state. Kinds run one
after another, in the order given (repeat a kind to interleave them):

    python bench/bench_variants_steady.py --kinds lora dora lora dora --out results/variants.json

--exports runs the kinds on each of several exports in the cache, in turn (e.g. an int4 base
with float32 and with int8 adapter rows: --exports ort_lora_int4 ort_lora_int4_int8).

Adapters and export: `ort-lora bench`'s cache (run it once with --experiments variants), i.e.
rank-16 random adapters on all seven modules of SmolLM2 and the same adapters as DoRA adapters.
kinds: lora (request i on adapter i % 16), dora (the same with the DoRA adapters), compose
(adapters i and i + 1 at weight 0.5 each), base.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from ort_lora.config import EngineConfig
from ort_lora.engine.llm_engine import LLMEngine
from ort_lora.lora_request import LoRARequest
from ort_lora.sampling_params import SamplingParams

KINDS = ("lora", "dora", "compose", "base")


def lora_of(kind: str, i: int, loras: list):
    """Request i's adapters: one, two composed at weight 0.5, or none."""
    if kind == "base":
        return None
    if kind == "compose":
        return [replace(loras[i % 16], weight=0.5), replace(loras[(i + 1) % 16], weight=0.5)]
    return loras[i % 16]


def run_kind(kind: str, cache: Path, reps: int, threads: int, export: str = "ort_lora") -> dict:
    root = cache / ("adapters_r16_s0_dora" if kind == "dora" else "adapters_r16_s0")
    config = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048)
    engine = LLMEngine(cache / export, config, intra_op_num_threads=threads, seed=0)
    loras = [LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")) for i in range(16)]
    t0 = time.perf_counter()
    for lora in loras:
        engine.add_lora(lora)
    out = {"kind": kind, "export": export, "register_s": time.perf_counter() - t0, "passes": []}
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(10_000, 49_000, 8)] for _ in range(32)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for rep in range(reps):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{rep}-{i}", prompt, params, lora_of(kind, i, loras))
        runs, wall, cpu = [], time.perf_counter(), time.process_time()
        while engine.has_unfinished_requests():
            engine.step()
            runs.append(engine.times.phases.get("run", 0.0))
        p = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}
        p |= {"steps": len(runs), "median_run_ms": 1e3 * float(np.median(runs))}
        p["loadavg"] = os.getloadavg()[0]
        out["passes"].append(p)
        print(export, kind, rep, {k: round(v, 2) for k, v in p.items()}, flush=True)
    engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=["lora", "dora"])
    parser.add_argument("--reps", type=int, default=3, help="passes of the workload per kind")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--cache",
        default=os.path.expanduser("~/.cache/ort-lora/bench/smollm2"),
        help="ort-lora bench's cache of the model (its export and adapters)",
    )
    parser.add_argument("--exports", nargs="+", default=["ort_lora"], help="exports in --cache")
    parser.add_argument("--out", default="results/bench_variants_steady.json")
    args = parser.parse_args()
    cache = Path(args.cache)
    results = [
        run_kind(k, cache, args.reps, args.threads, e) for e in args.exports for k in args.kinds
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "runs": results}, indent=1))
    steady = {}
    for r in results:  # pass 0 loads the adapters: the steady state is the rest
        key = f"{r['export']} {r['kind']}"
        steady.setdefault(key, []).extend(p["wall_s"] for p in r["passes"][1:])
    for key, walls in steady.items():
        print(f"{key}: steady-state pass {np.mean(walls):.2f} s (n={len(walls)})")


if __name__ == "__main__":
    main()
