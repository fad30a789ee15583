"""What a step's LoraSGMV nodes cost requests without adapters, measured in one process: one
request at a time (8 prompt + 64 new tokens, EOS ignored, no adapter) on an export and on a
copy of it without its LoraSGMV nodes, their steps taken in turn.

    python bench/bench_lora_nodes.py --out docs/bench/lora-nodes/inprocess.json
    python bench/bench_lora_nodes.py --exports int4,float32 --rounds 8

In a step without adapters every LoraSGMV node hands its y through unchanged (in place), so
the copy (strip_lora_nodes: each node's outputs replaced by its y inputs) computes the same
logits (its greedy tokens are checked against the export's before timing); the difference in
speed is what ORT's dispatch of those nodes and their input lookups cost a request that uses
no adapter. The exports are bench_lora_cost.py's (SmolLM2, built once into --cache-dir).
Prints each round's ratio and the rates, writes them (with the command, date, machine and
load) as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

PROMPT, NEW_TOKENS, REQUESTS = 8, 64, 4  # requests a round, one at a time
VOCAB = 49152
EXPORTS = ("int4", "float32")


def strip_lora_nodes(model_dir: Path, out_dir: Path) -> Path:
    """A copy of the export in model_dir at out_dir without LoraSGMV nodes: wherever a node's
    output m is read, its input y_m is read instead (ort_lora.contract.lora_sgmv_module_inputs),
    and the graph inputs nothing reads any more are dropped. The other files are copied (ONNX
    Runtime reads external data only from the model's own directory; onnx refuses external
    data with several hard links)."""
    import onnx

    from ort_lora import contract as C

    out_dir.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.name != C.MODEL_NAME and f.is_file():
            shutil.copy2(f, out_dir / f.name)
    model = onnx.load(str(model_dir / C.MODEL_NAME), load_external_data=False)
    graph, through = model.graph, {}
    for node in graph.node:
        if node.op_type == "LoraSGMV":
            for m, out in enumerate(node.output):
                through[out] = node.input[C.lora_sgmv_module_inputs(m)[0]]
    kept = [n for n in graph.node if n.op_type != "LoraSGMV"]
    for node in kept:
        for i, name in enumerate(node.input):
            while name in through:  # a node's y may be another node's output
                name = through[name]
            node.input[i] = name
    for out in graph.output:
        while out.name in through:
            out.name = through[out.name]
    read = {name for n in kept for name in n.input}
    inputs = [i for i in graph.input if i.name in read]
    del graph.node[:], graph.input[:]
    graph.node.extend(kept)
    graph.input.extend(inputs)
    onnx.save(model, str(out_dir / C.MODEL_NAME))
    return out_dir


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
        stripped = strip_lora_nodes(models[n], Path(args.cache_dir) / "lora-nodes" / n)
        engines = {"export": engine(models[n], [], args.threads)[0]}
        engines["without LoraSGMV"] = engine(stripped, [], args.threads)[0]
        tokens = one_at_a_time(engines, f"warm-{n}")[1]
        if tokens["export"] != tokens["without LoraSGMV"]:
            raise SystemExit(f"{n}: the copy without LoraSGMV generated other tokens")
        rates = {role: [] for role in engines}
        for r in range(args.rounds):
            for role, rate in one_at_a_time(engines, f"{n}-{r}")[0].items():
                rates[role].append(rate)
        ratio = [s / e for s, e in zip(rates["without LoraSGMV"], rates["export"])]
        doc["exports"][n] = {**rates, "ratio": ratio, "median_ratio": statistics.median(ratio)}
        print(f"{n}: without LoraSGMV / export, one request at a time: median "
              f"{statistics.median(ratio):.3f}, rounds " + " ".join(f"{x:.3f}" for x in ratio)
              + f"; tok/s {statistics.median(rates['export']):.1f}, "
              f"{statistics.median(rates['without LoraSGMV']):.1f}")  # fmt: skip
    doc["loadavg_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
