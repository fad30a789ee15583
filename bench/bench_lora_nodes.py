"""What a step's LoraSGMV nodes cost requests without adapters, measured in one process: one
request at a time (8 prompt + 64 new tokens, EOS ignored, no adapter) on an engine that runs
every step on the export's graph and on one that runs such steps on its base graph (the export
without LoraSGMV nodes, EngineConfig.base_graph), their steps taken in turn.

    python bench/bench_lora_nodes.py --out docs/bench/lora-nodes/inprocess.json
    python bench/bench_lora_nodes.py --exports int4,float32 --rounds 8

In a step without adapters every LoraSGMV node hands its y through unchanged (in place), so
the base graph computes the same logits (the engines' greedy tokens are checked against each
other before timing); the difference in speed is what ORT's dispatch of those nodes, their
input lookups and the LoRA inputs' host work cost a request that uses no adapter. The exports
are bench_lora_cost.py's (SmolLM2, built once into --cache-dir). Prints each round's ratio and
the rates, writes them (with the command, date, machine and load) as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

PROMPT, NEW_TOKENS, REQUESTS = 8, 64, 4  # requests a round, one at a time
VOCAB = 49152
EXPORTS = ("int4", "float32")
BASE = "base graph"  # the engine whose steps without adapters run the base graph


def prompts(n: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(100, VOCAB, PROMPT).tolist() for _ in range(n)]


def params(max_tokens: int):
    from ort_lora.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def one_at_a_time(engines: dict, tag: str) -> tuple[dict[str, float], dict[str, list]]:
    """Output tok/s of REQUESTS requests, one at a time, on each engine, each engine's request
    stepped in turn with the others' and each rate counting only its own engine's steps; and
    the (greedy) tokens each engine generated."""
    from bench_lora_cost import step_in_turn

    spent = dict.fromkeys(engines, 0.0)
    tokens = {role: [] for role in engines}
    for i, prompt in enumerate(prompts(REQUESTS)):
        for role, eng in engines.items():
            eng.add_request(f"{tag}-{role}-{i}", prompt, params(NEW_TOKENS), None)
        seconds, finished = step_in_turn(engines)
        for role in engines:
            spent[role] += seconds[role]
            tokens[role] += [list(o.outputs[0].token_ids) for o in finished[role]]
    return {role: REQUESTS * NEW_TOKENS / t for role, t in spent.items()}, tokens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/lora_nodes.json")
    p.add_argument("--cache-dir", default=".cache/bench")
    p.add_argument("--exports", default="int4", help=f"comma-separated, of {EXPORTS}")
    p.add_argument("--rounds", type=int, default=6, help="rounds of REQUESTS requests each")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    names = args.exports.split(",")
    if set(names) - set(EXPORTS):
        p.error(f"--exports: one or more of {list(EXPORTS)}, got {args.exports!r}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_lora_cost import build, engine, run_doc
    from bench_ops import share_one_pool

    models, _ = build(Path(args.cache_dir), names, "auto", [])
    share_one_pool(args.threads)  # the engines, stepped in turn, on one thread pool
    doc = run_doc("bench_lora_nodes.py", args.threads, exports={})
    for n in names:
        engines = {"export": engine(models[n], [], args.threads, base_graph=False)[0]}
        engines[BASE] = engine(models[n], [], args.threads, base_graph=True)[0]
        tokens = one_at_a_time(engines, f"warm-{n}")[1]
        if tokens["export"] != tokens[BASE]:
            raise SystemExit(f"{n}: the base graph generated other tokens")
        rates = {role: [] for role in engines}
        for r in range(args.rounds):
            for role, rate in one_at_a_time(engines, f"{n}-{r}")[0].items():
                rates[role].append(rate)
        ratio = [s / e for s, e in zip(rates[BASE], rates["export"])]
        doc["exports"][n] = {**rates, "ratio": ratio, "median_ratio": statistics.median(ratio)}
        print(f"{n}: base graph / export, one request at a time: median "
              f"{statistics.median(ratio):.3f}, rounds " + " ".join(f"{x:.3f}" for x in ratio)
              + f"; tok/s {statistics.median(rates['export']):.1f}, "
              f"{statistics.median(rates[BASE]):.1f}")  # fmt: skip
    doc["loadavg_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
