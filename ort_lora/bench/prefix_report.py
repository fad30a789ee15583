"""The prefix experiment's results: its table (with the prefix cache's hit rate), its
targets as PASS / MISS, and its plot (TTFT p50 and output tokens/s per row).

Targets (ratios of rows of the same run; docs/BENCHMARKS.md, "Prefix caching"):
    chat trace, int4 and float32: caching on vs off, TTFT p50 >= 5x lower and output tok/s
    >= 2x; float32, on the chat trace's first conversations: ort-lora caching on >= 3x
    vLLM-CPU with prefix caching in output tok/s; unshared trace (int4): caching on / off
    throughput >= 0.97.
A row run more than once (the unshared trace's) counts by its fastest run, the least
disturbed on a shared machine.
"""

from __future__ import annotations

from pathlib import Path

EXPERIMENT = "prefix"
COLUMNS = (
    ("label", "system", "{}"),
    ("workload", "trace", "{}"),
    ("num_requests", "requests", "{}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("output_tok_s", "out tok/s", "{:.1f}"),
    ("output_tok_per_cpu_s", "tok/CPU-s", "{:.1f}"),
    ("hit_rate", "hit rate", "{:.1%}"),
    ("peak_rss_mb", "peak RSS MiB", "{:.0f}"),
    ("load", "load 1m start/end", "{}"),
)


def rows_of(results: list[dict]) -> list[dict]:
    return [r for r in results if r["experiment"] == EXPERIMENT]


def best(results: list[dict], label: str) -> dict | None:
    """The fastest successful run of a row (by output tok/s), None if it has none."""
    runs = [r for r in rows_of(results) if r["label"] == label and "error" not in r]
    return max(runs, key=lambda r: r["output_tok_s"], default=None)


def _cell(row: dict, key: str):
    if key == "hit_rate":
        return row.get("extra", {}).get("hit_rate")
    if key == "load":
        if row.get("loadavg_start") is None:
            return None
        return f"{row['loadavg_start'][0]:.1f} / {row['loadavg_end'][0]:.1f}"
    return row.get(key)


def table(rows: list[dict]) -> str:
    """A markdown table of the prefix rows, errors shown inline."""
    lines = ["| " + " | ".join(c[1] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        if "error" in r:
            cells = [r["label"], r["workload"], f"error: {r['error'][:120]}"]
            cells += [""] * (len(COLUMNS) - len(cells))
        else:
            cells = ["-" if (v := _cell(r, k)) is None else f.format(v) for k, _, f in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    if a is None or b is None or not b.get(key):
        return None
    return a[key] / b[key]


# the row pairs compared (labels of plan.PREFIX_ROWS and PREFIX_UNSHARED_ROWS)
VLLM_OURS = "short trace: ort-lora float32 caching on"
VLLM = "short trace: vLLM float32 prefix caching"
UNSHARED = "unshared: ort-lora int4 caching {}"


def targets(results: list[dict]) -> list[tuple]:
    """(what, measured by wall clock, measured by CPU time or None, goal) of every prefix
    target (the form of report.targets); a measurement is None where a row is missing."""
    if not rows_of(results):
        return []
    out = []
    for model in ("int4", "float32"):
        on = best(results, f"ort-lora {model} caching on")
        off = best(results, f"ort-lora {model} caching off")
        ttft = _ratio(off, on, "ttft_p50_ms")
        out.append((f"prefix {model}: TTFT p50 caching off / on", ttft, None, 5.0))
        out.append((f"prefix {model}: out tok/s caching on / off", *_both(on, off), 2.0))
    ours, vllm = best(results, VLLM_OURS), best(results, VLLM)
    what = "prefix float32: ort-lora caching on / vLLM prefix caching (short trace)"
    out.append((what, *_both(ours, vllm), 3.0))
    on, off = best(results, UNSHARED.format("on")), best(results, UNSHARED.format("off"))
    out.append(("prefix unshared int4: out tok/s caching on / off", *_both(on, off), 0.97))
    return out


def _both(a: dict | None, b: dict | None) -> tuple[float | None, float | None]:
    return _ratio(a, b, "output_tok_s"), _ratio(a, b, "output_tok_per_cpu_s")


def verdict(measured: float | None, goal: float) -> str:
    """PASS / MISS of a lower-bound goal; "-" when a row it needs is missing or failed."""
    if measured is None:
        return "-"
    return "PASS" if measured >= goal else "MISS"


def targets_table(checks: list[tuple]) -> str:
    lines = ["| target | wall clock | CPU time | goal | |", "|---|---|---|---|---|"]
    for what, wall, cpu, goal in checks:
        cells = ["-" if v is None else f"{v:.2f}" for v in (wall, cpu)]
        lines.append(
            f"| {what} | {cells[0]} | {cells[1]} | >= {goal:.2f} | {verdict(wall, goal)} |"
        )
    return "\n".join(lines)


def summary(results: list[dict]) -> str:
    """The table and the targets, as `ort-lora bench` prints them at the end of a run."""
    return "\n".join(["", table(rows_of(results)), "", targets_table(targets(results)), ""])


def plot(results: list[dict], path: Path) -> Path | None:
    """TTFT p50 and output tok/s of every successful prefix row (plots.latency_and_rate_plot);
    None (no file) when there is none."""
    from ort_lora.bench.plots import latency_and_rate_plot

    ok = [r for r in rows_of(results) if "error" not in r]
    if not ok:
        return None
    on = [bool(r.get("extra", {}).get("prefix_caching")) for r in ok]
    return latency_and_rate_plot(ok, on, "prefix caching (green: on, gray: off)", path)
