"""Results -> markdown tables, target checks and PNG plots (matplotlib, no display needed)."""

from __future__ import annotations

COLUMNS = (
    ("output_tok_s", "out tok/s", "{:.1f}"),
    ("requests_s", "req/s", "{:.2f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("itl_p50_ms", "ITL p50 ms", "{:.1f}"),
    ("itl_p99_ms", "ITL p99 ms", "{:.1f}"),
    ("peak_rss_mb", "peak RSS MiB", "{:.0f}"),
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
            cells = [_fmt(fmt, r.get(key)) for key, _, fmt in COLUMNS]
        lines.append("| " + " | ".join([r["label"], r["workload"], *cells]) + " |")
    return "\n".join(lines)


def _fmt(fmt: str, value) -> str:
    return "-" if value is None else fmt.format(value)


def _ratio(a: dict | None, b: dict | None) -> float | None:
    if a is None or b is None:
        return None
    return a["output_tok_s"] / b["output_tok_s"]


def targets(results: list[dict], shapes: list[str]) -> list[tuple[str, float | None, float]]:
    """(what, measured, target) for each target of issue 7 the run can check."""
    out = []
    for shape in shapes:
        exp = f"systems/{shape}"
        mixed = find(results, exp, "ort-lora mixed")
        for other, goal in (
            ("onnxruntime-genai base", 1.0),
            ("transformers+PEFT mixed", 3.4 if shape == "decode-heavy" else 2.6),
            ("onnxruntime-genai multi-LoRA (grouped)", 4.5),
        ):
            out.append(
                (
                    f"{shape}: ort-lora mixed / {other}",
                    _ratio(mixed, find(results, exp, other)),
                    goal,
                )
            )
    base = find(results, "popularity", "ort-lora base")
    for pattern, goal in (("identical", 0.9), ("uniform", 0.8), ("distinct", 0.6)):
        r = find(results, "popularity", f"ort-lora {pattern}")
        out.append((f"LoRA cost: {pattern} / base", _ratio(r, base), goal))
    regs = sorted(
        (r for r in rows_of(results, "registered") if "error" not in r),
        key=lambda r: r["num_adapters"],
    )
    if len(regs) >= 2:
        out.append(
            (
                f"{regs[-1]['num_adapters']} vs {regs[0]['num_adapters']} registered",
                _ratio(regs[-1], regs[0]),
                0.9,
            )
        )
    pre = find(results, "prefill", "ort-lora base prefill")
    if pre is not None:
        e = pre["extra"]
        rate = e["prefill_gflop"] / pre["duration_s"]
        out.append(("base prefill GFLOP/s / sgemm GFLOP/s", rate / e["sgemm_gflops"], 0.6))
    mixed = find(results, f"systems/{shapes[0]}", "ort-lora mixed")
    if mixed is not None and "host_share_at_max_seqs" in mixed["extra"]:
        out.append(
            (
                "host share of a step at max seqs (<=)",
                mixed["extra"]["host_share_at_max_seqs"],
                0.10,
            )
        )
    return out


def targets_table(rows) -> str:
    lines = ["| target | measured | goal | met |", "|---|---|---|---|"]
    for what, value, goal in rows:
        upper = what.endswith("(<=)")
        met = (
            "-"
            if value is None
            else ("yes" if (value <= goal if upper else value >= goal) else "no")
        )
        shown = "-" if value is None else f"{value:.2f}"
        lines.append(f"| {what} | {shown} | {'<=' if upper else '>='} {goal:.2f} | {met} |")
    return "\n".join(lines)
