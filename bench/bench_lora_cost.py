"""What LoRA costs beside the base model, measured in one process: 32 decode-heavy requests
(8 prompt + 64 new tokens, EOS ignored) over 16 adapters (request i on adapter i % 16; with
--pattern skewed, Zipf popularity; identical, all on one) against the same 32 requests with no
adapter, on each export, in alternating rounds.

    python bench/bench_lora_cost.py --out docs/bench/lora-cost/inprocess.json
    python bench/bench_lora_cost.py --exports int4 --rounds 8 --adapter-dtype int8
    python bench/bench_lora_cost.py --saved float16  # the same adapters saved in float16
    python bench/bench_lora_cost.py --saved float32,float16  # both sets, in the same rounds
    python bench/bench_lora_cost.py --against-library OLD.so  # a kernel change, in turn
    python bench/bench_lora_cost.py --scattered-pages  # KV blocks scattered over the pool
    python bench/bench_lora_cost.py --pattern identical  # every request on one adapter

`ort-lora bench --experiments quant` times each row in a process of its own, one after
another; on a VM whose speed moves from minute to minute (the int4 base read 742-1051 tok/s
in three such runs on one machine) the ratio of two rows moves with it, and even rounds a few
seconds apart in one process read 0.70-0.97. Here each export has two engines in one process,
on one thread pool (bench_ops.share_one_pool): one serves the requests over the adapters, the
other the same requests without, and their steps alternate, so a round's ratio compares steps
taken tens of milliseconds apart.

The exports and adapters are the benchmark's own (ort_lora/bench/assets.py: SmolLM2-135M from
its GGUF, 16 seeded random rank-16 PEFT adapters of all seven modules), built once into
--cache-dir and shared with `ort-lora bench`; --saved float16 or bfloat16 saves copies of them
in that type, which the default export (adapter rows "auto") serves from 16-bit rows. With
several --saved types each export has a mixed engine per type beside its one base engine, and
every round serves them all in turn, so their ratios share the rounds. With --against-library
each engine, mixed and base, has a twin on another build of the op library, served in the same
rounds (a kernel change timed in the engine, in turn with the build it changes: each build's
LoRA cost, and this build's speed over the other's with and without adapters). Prints a
table, writes the rounds and medians (with the command, date, machine and load) as JSON and
a plot beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

from tqdm import tqdm

from ort_lora.adapter_rows import AUTO, ROW_TYPES

REQUESTS, ADAPTERS, PROMPT, NEW_TOKENS = 32, 16, 8, 64
VOCAB = 49152  # SmolLM2's: the prompts' token ids are drawn from it
EXPORTS = ("int4", "float32")
PATTERNS = ("uniform", "skewed", "identical")  # --pattern: ort_lora.bench.workloads' patterns
BASE_ROLES = ("base", "other base")  # the engines that serve the requests without adapters
SAVED = ("float32", "float16", "bfloat16")  # the dtypes --saved can save the adapters in


def build(
    cache: Path, names: list[str], adapter_dtype: str, saved: list[str]
) -> tuple[dict[str, Path], dict[str, list]]:
    """The named exports of SmolLM2 and the 16 adapters saved in each dtype of `saved`
    (dtype -> their directories), made once into `cache`."""
    from ort_lora.bench import assets

    source = assets.ModelSource("smollm2")
    root = cache / source.name
    hf = source.hf_checkpoint(root)
    made = {
        "float32": lambda: assets.ort_lora_model(hf, root, 16, adapter_dtype),
        "int4": lambda: assets.ort_lora_int4(source, hf, root, 16, adapter_dtype),
    }
    adapters = {s: assets.random_adapters(hf, root, ADAPTERS, 16, 0, saved=s) for s in saved}
    return {n: made[n]() for n in names}, adapters


def engine(
    model: Path,
    adapters: list,
    threads: int,
    library: str | None = None,
    base_graph=None,
    scattered: bool = False,
):
    """An LLMEngine on `model` with every adapter registered (rows copied into the pool), its
    ops from `library` (default: this build's), EngineConfig.base_graph `base_graph`; with
    `scattered`, its free pages put in one seeded random order first (PagePool.scatter_free)."""
    from ort_lora.config import EngineConfig
    from ort_lora.engine.llm_engine import LLMEngine
    from ort_lora.lora_request import LoRARequest

    config = EngineConfig(
        max_num_seqs=64, max_num_batched_tokens=2048, preload_adapters=True, base_graph=base_graph
    )
    override = {"ORT_LORA_LIBRARY": library} if library else {}
    with mock.patch.dict(os.environ, override):  # read once, when the session is made
        eng = LLMEngine(str(model), config, intra_op_num_threads=threads, seed=0)
    if scattered:
        eng.pool.scatter_free()
    loras = [LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters)]
    for lora in loras:
        eng.add_lora(lora)
    return eng, loras


def prompt_ids(tokens: int, seed: int = 0) -> list[int]:
    """A prompt of `tokens` token ids of SmolLM2's vocabulary, drawn with `seed`."""
    import numpy as np

    return np.random.default_rng(seed).integers(100, VOCAB, tokens).tolist()


def submit(eng, loras: list | None, tag: str, pattern: str = "uniform") -> None:
    """The benchmark's decode-heavy requests, their adapters by `pattern` (of PATTERNS;
    "uniform": request i on adapter i % 16; loras None: the "base" workload, the same prompts
    without adapters)."""
    from ort_lora.bench.workloads import popularity_workload
    from ort_lora.sampling_params import SamplingParams

    pattern = pattern if loras else "base"
    work = popularity_workload(pattern, REQUESTS, PROMPT, NEW_TOKENS, VOCAB, ADAPTERS)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, r in enumerate(work.requests):
        lora = None if r.adapter is None else loras[r.adapter]
        eng.add_request(f"{tag}-{i}", list(r.prompt_ids), params, lora)


def serve_in_turn(
    engines: dict, loras: list, tag: str, pattern: str = "uniform"
) -> dict[str, float]:
    """Output tok/s of the 32 requests on each engine of `engines` (role -> engine: those of
    BASE_ROLES serve them without adapters, the others over the adapters by `pattern`; one
    export), their steps taken in turn: each rate counts only its own engine's steps, and a
    change in the machine's speed falls on all alike."""
    for role, eng in engines.items():
        submit(eng, None if role in BASE_ROLES else loras, f"{tag}-{role}", pattern)
    spent = step_in_turn(engines)[0]
    return {role: REQUESTS * NEW_TOKENS / t for role, t in spent.items()}


def step_in_turn(
    engines: dict, decode_steps: dict | None = None
) -> tuple[dict[str, float], dict[str, list]]:
    """Steps the engines (role -> engine) in turn until none has requests left: the seconds
    each spent in its own steps, and the outputs of the requests each finished. decode_steps
    (role -> list), if given, gets the seconds of each engine's steps that decoded only (a
    token per sequence: LLMEngine.times)."""
    spent = dict.fromkeys(engines, 0.0)
    finished = {role: [] for role in engines}
    while any(eng.has_unfinished_requests() for eng in engines.values()):
        for role, eng in engines.items():
            if eng.has_unfinished_requests():
                start = time.perf_counter()
                outs = eng.step()
                seconds = time.perf_counter() - start
                spent[role] += seconds
                finished[role] += [o for o in outs if o.finished]
                if decode_steps is not None and eng.times.num_tokens == eng.times.num_seqs:
                    decode_steps[role].append(seconds)
    return spent, finished


def measure(sets: dict, rounds: int, pattern: str = "uniform") -> dict:
    """Per adapter set of an export: tok/s of each round for each engine (mixed, base and,
    with another library, other and other base: their twins) and the ratios: mixed / base
    (ratio), other / other base (other_ratio; other / base without an other base), and this
    build over the other (mixed_speedup: mixed / other, base_speedup: base / other base)."""
    runs = {n: {role: [] for role in engines} for n, (engines, _) in sets.items()}
    for name, (engines, loras) in sets.items():  # warm-up: every adapter's rows
        serve_in_turn(engines, loras, f"warm-{name}", pattern)
    for r in tqdm(range(rounds), desc="rounds", unit="round"):
        for name, (engines, loras) in sets.items():
            for role, rate in serve_in_turn(engines, loras, f"{name}-{r}", pattern).items():
                runs[name][role].append(rate)
    for run in runs.values():
        other_base = "other base" if "other base" in run else "base"
        pairs = [("mixed", "base", "ratio"), ("other", other_base, "other_ratio")]
        pairs += [("mixed", "other", "mixed_speedup"), ("base", "other base", "base_speedup")]
        for top, bottom, key in pairs:
            if top in run and bottom in run:
                run[key] = [m / b for m, b in zip(run[top], run[bottom])]
                run[f"median_{key}"] = statistics.median(run[key])
    return runs


def in_turn_options(p: argparse.ArgumentParser, rounds: int, rounds_help: str, twin: str) -> None:
    """The in-turn programs' --rounds (default `rounds`), --threads and --against-library (with
    which `twin` runs on another build of the op library, in turn)."""
    p.add_argument("--rounds", type=int, default=rounds, help=rounds_help)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--against-library",
        metavar="SO",
        help=f"another build of the op library: {twin} on it, in turn",
    )


def check_in_turn_options(p: argparse.ArgumentParser, args) -> None:
    """Usage errors for in_turn_options' values: no round, or no such library file."""
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.against_library and not Path(args.against_library).is_file():
        p.error(f"--against-library: no such file {args.against_library!r}")


def save_doc(doc: dict, out: str, plot) -> None:
    """doc as JSON at `out` (its folder made) and plot(doc, path) as a PNG beside it; says
    where."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    plot(doc, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png')}")


def run_doc(program: str, threads: int, **fields) -> dict:
    """A result file's head: the command that made it (bench/`program` with this process's
    arguments), date, CPU, ISA, threads, `fields`, and the load average now."""
    from ort_lora.bench.cli import cpu_isa, cpu_name

    return {
        "command": f"python bench/{program} " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": cpu_name(),
        "isa": cpu_isa(),
        "threads": threads,
        **fields,
        "loadavg_start": os.getloadavg(),
    }


def over(doc: dict) -> str:
    """What the mixed engines serve: "16 adapters mixed", or the --pattern's name."""
    pattern = doc.get("pattern", "uniform")
    return "16 adapters mixed" if pattern == "uniform" else f"16 adapters, {pattern}"


def report(doc: dict) -> str:
    lines = [
        f"LoRA cost in one process ({doc['cpu']}, {doc['isa']}, {doc['threads']} threads, "
        f"adapter rows {doc['adapter_dtype']}, adapters saved in {doc.get('saved', 'float32')}"
        f"{', pages scattered' if doc.get('scattered_pages') else ''}"
        f"): {over(doc)} / base, decode-heavy",
        f"{'export':<22} {'median':>7}  rounds (mixed / base)                tok/s mixed, base",
    ]
    for name, run in doc["exports"].items():
        ratios = " ".join(f"{x:.3f}" for x in run["ratio"])
        tok = f"{statistics.median(run['mixed']):.0f}, {statistics.median(run['base']):.0f}"
        lines.append(f"{name:<22} {run['median_ratio']:>7.3f}  {ratios:<36} {tok}")
        if "other" in run:
            ratios = " ".join(f"{x:.3f}" for x in run["other_ratio"])
            lines.append(f"{'  other library':<22} {run['median_other_ratio']:>7.3f}  {ratios}")
        for key, what in (("mixed_speedup", "mixed"), ("base_speedup", "base")):
            if key in run:
                ratios = " ".join(f"{x:.3f}" for x in run[key])
                label = f"  this / other, {what}"
                lines.append(f"{label:<22} {run[f'median_{key}']:>7.3f}  {ratios}")
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, run in doc["exports"].items():
        rounds = range(1, len(run["ratio"]) + 1)
        (line,) = ax.plot(
            rounds, run["ratio"], "o-", label=f"{name} (median {run['median_ratio']:.2f})"
        )
        if "other_ratio" in run:
            label = f"{name}, other library (median {run['median_other_ratio']:.2f})"
            ax.plot(rounds, run["other_ratio"], "x--", color=line.get_color(), label=label)
    ax.axhline(0.92, color="gray", linestyle="--", label="goal 0.92")
    ax.set(xlabel="round", ylabel=f"{over(doc)} / base", ylim=(0, 1.05))
    ax.set_title(f"LoRA cost per round, one process ({doc['isa']})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/lora_cost.json")
    p.add_argument("--cache-dir", default=".cache/bench")
    p.add_argument("--exports", default="int4,float32", help=f"comma-separated, of {EXPORTS}")
    p.add_argument("--adapter-dtype", default=AUTO, choices=[AUTO, *ROW_TYPES])
    p.add_argument(
        "--saved",
        default="float32",
        help=f"comma-separated, of {SAVED}: the dtypes the adapters are saved in (auto rows: "
        "float16 or bfloat16 ones take 16-bit rows)",
    )
    p.add_argument(
        "--scattered-pages",
        action="store_true",
        help="every engine's free pages in one random order, as in a pool after many requests "
        "have come and gone (requests' KV blocks then lie scattered over the pool)",
    )
    p.add_argument(
        "--pattern",
        default="uniform",
        choices=PATTERNS,
        help="the requests' adapters: uniform (request i on adapter i %% 16), skewed (Zipf "
        "popularity), identical (all on the first)",
    )
    in_turn_options(p, 6, "alternating mixed / base rounds", "each engine gets a twin")
    args = p.parse_args(argv)
    names = args.exports.split(",")
    if set(names) - set(EXPORTS):
        p.error(f"--exports: one or more of {list(EXPORTS)}, got {args.exports!r}")
    saved = args.saved.split(",")
    if set(saved) - set(SAVED) or len(set(saved)) < len(saved):
        p.error(f"--saved: distinct dtypes of {list(SAVED)}, got {args.saved!r}")
    check_in_turn_options(p, args)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_ops import share_one_pool

    models, adapters = build(Path(args.cache_dir), names, args.adapter_dtype, saved)
    share_one_pool(args.threads)  # the engines, timed in turn, on one thread pool
    sets = {}

    def make(model, served, library=None):
        return engine(model, served, args.threads, library, scattered=args.scattered_pages)

    for n in names:  # engines of each export: one per adapter set, and one for the base
        base = {"base": make(models[n], [])[0]}
        if args.against_library:
            base["other base"] = make(models[n], [], args.against_library)[0]
        for s in saved:
            mixed, loras = make(models[n], adapters[s])
            engines = {"mixed": mixed, **base}
            if args.against_library:
                engines["other"] = make(models[n], adapters[s], args.against_library)[0]
            sets[n if len(saved) == 1 else f"{n}, saved {s}"] = (engines, loras)
    doc = run_doc(
        "bench_lora_cost.py",
        args.threads,
        adapter_dtype=args.adapter_dtype,
        saved=args.saved,
        against_library=args.against_library,
        scattered_pages=args.scattered_pages,
        pattern=args.pattern,
    )
    doc["exports"] = measure(sets, args.rounds, args.pattern)
    doc["loadavg_end"] = os.getloadavg()
    print(report(doc))
    save_doc(doc, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
