"""Results -> markdown tables, target checks and PNG plots (matplotlib, no display needed)."""

from __future__ import annotations

from ort_lora.bench import prefix_report

COLUMNS = (
    ("output_tok_s", "out tok/s", "{:.1f}"),
    ("output_tok_per_cpu_s", "tok/CPU-s", "{:.1f}"),
    ("requests_s", "req/s", "{:.2f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("itl_p50_ms", "ITL p50 ms", "{:.1f}"),
    ("itl_p99_ms", "ITL p99 ms", "{:.1f}"),
    ("peak_rss_mb", "peak RSS MiB", "{:.0f}"),
    ("load", "load 1m start/end", "{}"),
)


def rows_of(results: list[dict], experiment: str) -> list[dict]:
    return [r for r in results if r["experiment"] == experiment]


def find(results: list[dict], experiment: str, label: str) -> dict | None:
    for r in rows_of(results, experiment):
        if r["label"] == label and "error" not in r:
            return r
    return None


def table(rows: list[dict]) -> str:
    """A markdown table of the standard columns, one line per run (errors shown inline)."""
    head = ["system", "workload", *[c[1] for c in COLUMNS]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            cells = [f"error: {r['error'][:120]}"] + [""] * (len(COLUMNS) - 1)
        else:
            cells = [_fmt(fmt, _cell(r, key)) for key, _, fmt in COLUMNS]
        lines.append("| " + " | ".join([r["label"], r["workload"], *cells]) + " |")
    return "\n".join(lines)


def _cell(row: dict, key: str):
    if key != "load":
        return row.get(key)
    if row.get("loadavg_start") is None:
        return None
    return f"{row['loadavg_start'][0]:.1f} / {row['loadavg_end'][0]:.1f}"


def _fmt(fmt: str, value) -> str:
    return "-" if value is None else fmt.format(value)


def _ratio(a: dict | None, b: dict | None, key: str = "output_tok_s") -> float | None:
    if a is None or b is None:
        return None
    return a[key] / b[key]


def _both(a: dict | None, b: dict | None) -> tuple[float | None, float | None]:
    """Throughput ratio a / b by wall clock and by CPU seconds (tokens per CPU-second)."""
    return _ratio(a, b), _ratio(a, b, "output_tok_per_cpu_s")


def targets(results: list[dict], shapes: list[str]) -> list[tuple]:
    """(what, measured by wall clock, measured by CPU time or None, goal) for each target the
    run can check (docs/BENCHMARK_NOTES.md, "Targets"); a name ending "(<=)" is an upper bound, a
    goal of None a comparison without one."""
    out = []
    for shape in shapes:
        exp = f"systems/{shape}"
        if not rows_of(results, exp):  # a run without the systems experiment
            continue
        for ours, other, goal in (
            ("ort-lora mixed", "onnxruntime-genai base", 1.0),
            ("ort-lora mixed", "transformers+PEFT mixed", 3.4 if shape == "decode-heavy" else 2.6),
            ("ort-lora mixed", "onnxruntime-genai multi-LoRA (grouped)", 4.5),
            ("ort-lora mixed", "vLLM mixed", 5.0),
            ("ort-lora HTTP mixed", "vLLM HTTP mixed", 5.0),
            ("ort-lora base", "vLLM base", 1.1),
            # the most the mixed row could reach if LoRA cost ort-lora nothing: no goal
            ("ort-lora base", "vLLM mixed", None),
            # the ORT user's route today (one merged export per adapter): compared, no goal set
            ("ort-lora mixed", "Optimum merged per adapter (grouped)", None),
            ("ort-lora base", "Optimum base", None),
        ):
            a, b = find(results, exp, ours), find(results, exp, other)
            if b is not None or other.startswith(("onnxruntime", "transformers")):
                out.append((f"{shape}: {ours} / {other}", *_both(a, b), goal))
    base = find(results, "popularity", "ort-lora base")
    for pattern, goal in (("identical", 0.9), ("uniform", 0.8), ("distinct", 0.6)):
        r = find(results, "popularity", f"ort-lora {pattern}")
        if rows_of(results, "popularity"):
            out.append((f"LoRA cost: {pattern} / base", *_both(r, base), goal))
    regs = [r for r in rows_of(results, "registered") if "error" not in r]
    regs.sort(key=lambda r: r["num_adapters"])
    if len(regs) >= 2:
        what = f"{regs[-1]['num_adapters']} vs {regs[0]['num_adapters']} registered"
        out.append((what, *_both(regs[-1], regs[0]), 0.9))
        distinct = find(results, "popularity", "ort-lora distinct")
        what = f"{regs[-1]['num_adapters']} registered vs distinct adapters in the batch"
        out.append((what, *_both(regs[-1], distinct), 0.95))
    out += _scale_and_memory(results, shapes)
    out += _quant(results, shapes)
    pre = find(results, "prefill", "ort-lora base prefill")
    if pre is not None:
        e = pre["extra"]
        rate = e["prefill_gflop"] / pre["duration_s"] / e["sgemm_gflops"]
        out.append(("base prefill GFLOP/s / sgemm GFLOP/s", rate, None, 0.6))
    mixed = find(results, f"systems/{shapes[0]}", "ort-lora mixed")
    if mixed is not None and "host_share_at_max_seqs" in mixed["extra"]:
        share = mixed["extra"]["host_share_at_max_seqs"]
        out.append(("host share of a step at max seqs (<=)", share, None, 0.10))
    return out + _grammar(results) + _variants(results) + prefix_report.targets(results)


def _grammar(results: list[dict]) -> list[tuple]:
    """The cost of grammar masking with every running sequence under its own JSON
    schema, as a share of the constrained step: the step time added over the same requests
    unconstrained, and the masks' wait that the model's run did not hide. Each from the
    fastest of its runs (the least disturbed on a shared machine)."""
    from ort_lora.bench.plan import GRAMMAR_ROWS

    best = {}
    for label in GRAMMAR_ROWS:
        runs = [r for r in rows_of(results, "grammar") if r["label"] == label and "error" not in r]
        runs = [r for r in runs if "step_ms_at_max_seqs" in r["extra"]]
        if runs:
            best[label] = min(runs, key=lambda r: r["extra"]["step_ms_at_max_seqs"])["extra"]
    if len(best) < 2:
        return []
    ours, free = best[GRAMMAR_ROWS[0]], best[GRAMMAR_ROWS[1]]
    n, step = ours["max_seqs"], ours["step_ms_at_max_seqs"]
    added = (step - free["step_ms_at_max_seqs"]) / step
    wait = ours["host_ms"].get("grammar", 0.0) / step
    return [
        (f"grammar masking at {n} seqs: step time added / step (<=)", added, None, 0.10),
        (f"grammar masking at {n} seqs: unhidden mask time / step (<=)", wait, None, 0.10),
    ]


def _variants(results: list[dict]) -> list[tuple]:
    """DoRA and composition, from the fastest run of each row (the least disturbed on a shared
    machine): DoRA within 5 % of plain LoRA's throughput; 2 composed adapters per request cost
    one more adapter's LoRA part, no more: time(2) <= 2 time(1) - time(base), i.e. the
    throughput ratio 2 / 1 >= 1 / (2 - LoRA / base)."""
    from ort_lora.bench.plan import VARIANT_ROWS

    best = {}
    for label in VARIANT_ROWS:
        runs = [r for r in rows_of(results, "variants") if r["label"] == label and "error" not in r]
        if runs:
            best[label] = max(runs, key=lambda r: r["output_tok_s"])
    lora, dora, composed, base = (best.get(label) for label in VARIANT_ROWS)
    out = []
    if lora is not None and dora is not None:
        out.append(("DoRA / plain LoRA, same rank, uniform", *_both(dora, lora), 0.95))
    if lora is not None and composed is not None and base is not None:
        goal = 1 / (2 - lora["output_tok_s"] / base["output_tok_s"])
        out.append(("2 composed adapters / 1 adapter, uniform", *_both(composed, lora), goal))
    return out


def phases_table(rows: list[dict]) -> str:
    """Mean milliseconds per step at each run's most sequences, by engine phase."""
    ok = [r for r in rows if "error" not in r and "host_ms" in r.get("extra", {})]
    phases = sorted({k for r in ok for k in r["extra"]["host_ms"]}, key=lambda k: k != "run")
    head = ["system", "seqs", "step ms", *[f"{p} ms" for p in phases]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in ok:
        e = r["extra"]
        cells = [f"{e['host_ms'].get(p, 0.0):.2f}" for p in phases]
        lines.append(f"| {r['label']} | {e['max_seqs']} | {e['step_ms_at_max_seqs']:.2f} | "
                     + " | ".join(cells) + " |")  # fmt: skip
    return "\n".join(lines)


def _quant(results: list[dict], shapes: list[str]) -> list[tuple]:
    """The int4 targets: int4 base vs float32 base (decode-heavy) and vs onnxruntime-genai's
    int4 base, int4 mixed (16 adapters) vs genai int4 base; LoRA cost (mixed / base) of the
    int4 and float32 exports (goal 0.92 decode-heavy); the int4 server's peak RSS."""
    out = []
    for shape in shapes:
        exp = f"quant/{shape}"
        if not rows_of(results, exp):
            continue
        pairs = [("ort-lora int4 base", "onnxruntime-genai int4 base", 1.0)]
        pairs.append(("ort-lora int4 mixed", "onnxruntime-genai int4 base", 0.8))
        lora_goal = 0.92 if shape == "decode-heavy" else None
        for w in ("int4", "float32"):  # LoRA cost
            pairs.append((f"ort-lora {w} mixed", f"ort-lora {w} base", lora_goal))
        if shape == "decode-heavy":
            pairs.insert(0, ("ort-lora int4 base", "ort-lora float32 base", 1.5))
        for ours, other, goal in pairs:
            a, b = find(results, exp, ours), find(results, exp, other)
            out.append((f"{shape}: {ours} / {other}", *_both(a, b), goal))
    http = find(results, f"quant/{shapes[0]}", "ort-lora HTTP int4 mixed")
    genai = find(results, f"quant/{shapes[0]}", "onnxruntime-genai int4 base")
    if http is not None and genai is not None and "pool_mb" in http["extra"]:
        budget = 1.25 * genai["peak_rss_mb"] + http["extra"]["pool_mb"]
        what = "int4 server peak RSS / (1.25 x genai int4 peak + pool) (<=)"
        out.append((what, http["peak_rss_mb"] / budget, None, 1.0))
    return out


def _scale_and_memory(results: list[dict], shapes: list[str]) -> list[tuple]:
    out = []
    scale = {r["label"]: r for r in rows_of(results, "scale") if "error" not in r}
    uniform = next((r for k, r in scale.items() if k.startswith("ort-lora uniform")), None)
    base = next((r for k, r in scale.items() if k.startswith("ort-lora base")), None)
    if uniform is not None and base is not None:
        model = uniform["label"].split("(")[-1].rstrip(")")
        out.append((f"{model}: LoRA cost uniform / base", *_both(uniform, base), 0.85))
    for shape in shapes:  # the memory goal holds for every shape served, prefill included
        http = find(results, f"systems/{shape}", "ort-lora HTTP mixed")
        if http is None or "model_mb" not in http["extra"]:
            continue
        e = http["extra"]
        budget = e["model_mb"] + e["pool_mb"] + 300
        what = f"{shape}: HTTP peak RSS / (model + pool + 300 MB) (<=)"
        out.append((what, http["peak_rss_mb"] / budget, None, 1.0))
        genai = find(results, f"systems/{shape}", "onnxruntime-genai base")
        if genai is not None:
            ratio = (http["peak_rss_mb"] - e["pool_mb"]) / genai["peak_rss_mb"]
            what = f"{shape}: HTTP peak RSS less the pool / genai base peak (<=)"
            out.append((what, ratio, None, 1.5))
    return out


def targets_table(rows) -> str:
    lines = ["| target | wall clock | CPU time | goal | met (wall) |", "|---|---|---|---|---|"]
    for what, wall, cpu, goal in rows:
        upper = what.endswith("(<=)")
        cells = ["-" if v is None else f"{v:.2f}" for v in (wall, cpu)]
        if goal is None:  # a comparison without a goal
            lines.append(f"| {what} | {cells[0]} | {cells[1]} | - | - |")
            continue
        ok = wall is not None and (wall <= goal if upper else wall >= goal)
        met = "-" if wall is None else ("yes" if ok else "no")
        bound = f"{'<=' if upper else '>='} {goal:.2f}"
        lines.append(f"| {what} | {cells[0]} | {cells[1]} | {bound} | {met} |")
    return "\n".join(lines)
