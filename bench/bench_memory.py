"""Where ort-lora's memory goes: resident memory of the engine by component, and what ONNX
Runtime's session options change (each variant in a fresh process).

    python bench/bench_memory.py                          # SmolLM2 export in .cache/bench
    python bench/bench_memory.py --model DIR --adapters DIR1,DIR2,...

Per variant (session options), stages in one process, RSS (VmRSS) after each:
    python      numpy, onnxruntime and the engine's modules imported
    session     the ORT session alone (model weights as ORT holds them: initializers,
                prepacked copies, its arena so far); measured in its own process
    engine      LLMEngine built (session + pool, pre-touched, + tokenizer)
    adapters    16 adapters registered and loaded once (host adapter cache + pool pages)
    run         32 requests x (8 prompt + 64 new tokens) over the adapters (arena growth)
plus the peak (VmHWM) and the decode step time, so a memory cut is weighed against speed.
Saves results/bench_memory.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = {
    "default": {},
    "no prepacking": {"session.disable_prepacking": "1"},
    "no arena": {"enable_cpu_mem_arena": False},
    "no prepacking + no arena": {"session.disable_prepacking": "1", "enable_cpu_mem_arena": False},
}
POOL_MB = 512


def rss_mb(key: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def patch_session_options(options: dict) -> None:
    """Make every session this process creates use `options` (config entries or attributes)."""
    import ort_lora

    plain = ort_lora.session_options

    def patched(**config):
        opts = plain(**config)
        for key, value in options.items():
            if "." in key:
                opts.add_session_config_entry(key, value)
            else:
                setattr(opts, key, value)
        return opts

    ort_lora.session_options = patched


def measure_session(model: str, options: dict, threads: int) -> dict:
    import onnxruntime as ort

    import ort_lora
    import ort_lora.engine.llm_engine  # noqa: F401 (the engine's imports, as in measure_engine)

    patch_session_options(options)
    before = rss_mb()
    sess = ort.InferenceSession(
        str(Path(model) / "model.onnx"), ort_lora.session_options(intra_op_num_threads=threads)
    )
    assert sess is not None
    return {"python": before, "session": rss_mb() - before}


def measure_engine(model: str, adapters: list[str], options: dict, threads: int) -> dict:
    from ort_lora.engine.llm_engine import LLMEngine
    from ort_lora.lora_request import LoRARequest
    from ort_lora.sampling_params import SamplingParams

    patch_session_options(options)
    out = {"python": rss_mb()}
    engine = LLMEngine(model, pool_memory_bytes=POOL_MB << 20, intra_op_num_threads=threads)
    out["engine"] = rss_mb()
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i, lora in enumerate(loras):
        engine.add_request(f"w{i}", [100, 101, 102, 103], params, lora)
    while engine.has_unfinished_requests():
        engine.step()
    out["adapters"] = rss_mb()
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(32):
        prompt = [1000 + 7 * i + j for j in range(8)]
        engine.add_request(str(i), prompt, params, loras[i % len(loras)] if loras else None)
    steps = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    out["run"] = rss_mb()
    out["peak"] = rss_mb("VmHWM")
    out["step_ms_median"] = 1e3 * sorted(steps)[len(steps) // 2]
    out["pool_mb"] = POOL_MB
    return out


def child(argv: list[str]) -> int:
    what, model, adapters, variant, threads = argv
    options = VARIANTS[variant]
    if what == "session":
        res = measure_session(model, options, int(threads))
    else:
        res = measure_engine(model, [a for a in adapters.split(",") if a], options, int(threads))
    print(json.dumps(res))
    return 0


def run_child(what: str, model: str, adapters: list[str], variant: str, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--child", what, model, ",".join(adapters), variant]
    proc = subprocess.run([*cmd, str(threads)], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2:]))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=".cache/bench/smollm2/ort_lora")
    p.add_argument("--adapters", help="comma-separated PEFT dirs (default: the bench's 16)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="results/bench_memory.json")
    args = p.parse_args()
    adapters = args.adapters.split(",") if args.adapters else default_adapters(args.model)
    model_mb = sum(f.stat().st_size for f in Path(args.model).glob("model.onnx*")) / 2**20
    rows = []
    for variant in (v.strip() for v in args.variants.split(",")):
        s = run_child("session", args.model, adapters, variant, args.threads)
        e = run_child("engine", args.model, adapters, variant, args.threads)
        row = {"variant": variant, "model_mb": model_mb, "session_mb": s["session"], **e}
        row["rest_mb"] = e["engine"] - e["python"] - s["session"] - POOL_MB
        rows.append(row)
        print_row(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))


def default_adapters(model: str) -> list[str]:
    root = Path(model).parent / "adapters_r16_s0"
    return [str(root / f"a{i}") for i in range(16) if (root / f"a{i}").is_dir()]


def print_row(r: dict) -> None:
    print(
        f"{r['variant']:<26} model {r['model_mb']:.0f} | python {r['python']:.0f} | "
        f"ORT session +{r['session_mb']:.0f} | pool {r['pool_mb']} | engine rest "
        f"+{r['rest_mb']:.0f} | adapters +{r['adapters'] - r['engine']:.0f} | run "
        f"+{r['run'] - r['adapters']:.0f} | steady {r['run']:.0f} | peak {r['peak']:.0f} MiB | "
        f"step {r['step_ms_median']:.1f} ms",
        flush=True,
    )


if __name__ == "__main__":
    main()
