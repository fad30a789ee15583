"""Host time of one engine step: the wall time of LLMEngine.step() minus ONNX Runtime's run.

Everything the engine does around the model (schedule, adapter loads, graph inputs, sampling,
detokenizing, stop rules, bookkeeping) at decode: `--seqs` sequences over `--adapters` LoRA
adapters, one token each per step, on a model small enough that the host work is visible
(the tiny random Llama by default; `--model smollm2` for the real one). The figure is measured
the same way for any version of the engine (only `engine.times.run_s` and `num_seqs` are read),
so two checkouts compare directly:

    python bench/bench_engine_host.py                          # this checkout
    PYTHONPATH=../other python bench/bench_engine_host.py      # another one, same numbers

Prints and saves (results/bench_engine_host.json) the median over the full steps of each
repetition, with the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from ort_lora.bench.assets import ModelSource, ort_lora_model, random_adapters

try:
    from ort_lora.bench.cli import cpu_name
except ImportError:  # a checkout older than this program (it measures those too)
    cpu_name = platform.processor

RESULTS = Path(__file__).parent / "results" / "bench_engine_host.json"


def measure(model_dir: Path, adapters: list[Path], seqs: int, tokens: int, reps: int) -> list:
    """Host ms of every step that decoded all `seqs` sequences, per repetition."""
    from ort_lora.config import EngineConfig
    from ort_lora.engine.llm_engine import LLMEngine
    from ort_lora.lora_request import LoRARequest
    from ort_lora.sampling_params import SamplingParams

    config = EngineConfig(max_num_seqs=seqs, max_loras=max(1, len(adapters)), num_pages=2048)
    engine = LLMEngine(model_dir, config, intra_op_num_threads=1, seed=0)
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)] or [None]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    out = []
    for rep in range(reps):
        for i in range(seqs):
            prompt = [100 + i, 101, 102, 103, 104, 105]
            engine.add_request(f"{rep}-{i}", prompt, params, loras[i % len(loras)])
        host = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - start
            if engine.times.num_seqs == seqs and engine.times.num_tokens == seqs:
                host.append(1e3 * (wall - engine.times.run_s))
        out.append(host)
        print(f"  rep {rep}: host {statistics.median(host):.3f} ms/step over {len(host)} steps")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "ort-lora-bench")
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    source = ModelSource(args.model)
    cache = args.cache_dir / args.model
    hf = source.hf_checkpoint(cache)
    model_dir = ort_lora_model(hf, cache, source.block_size)
    adapters = random_adapters(hf, cache, args.adapters, rank=16, seed=0) if args.adapters else []
    print(f"engine host time, {args.model}: {args.seqs} seqs, {args.adapters} adapters")
    reps = measure(model_dir, adapters, args.seqs, args.tokens, args.reps)
    medians = [statistics.median(r) for r in reps]
    result = {
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {cpu_name()}",
        "loadavg_1_5_15_end": os.getloadavg(),
        "engine": str(Path(sys.modules["ort_lora"].__file__).parent),
        "host_ms_per_step": round(statistics.median(medians), 4),
        "host_ms_per_rep": [round(m, 4) for m in medians],
        **{k: getattr(args, k) for k in ("model", "seqs", "adapters", "tokens", "reps")},
    }
    print(f"host time per decode step: {result['host_ms_per_step']:.3f} ms (median of reps)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
