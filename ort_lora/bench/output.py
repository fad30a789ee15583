"""Write one bench run: results.json (schema below), report.md and the PNG plots.

results.json = {"schema": 1, "meta": {command, date, machine, cpu, ...},
                "results": [row, ...],
                "targets": [{"what", "measured", "measured_cpu", "goal"}, ...]}
row = {label, system, experiment, workload, num_requests, num_adapters, duration_s,
       output_tokens, output_tok_s, requests_s, cpu_s (CPU seconds of the system while
       measured), output_tok_per_cpu_s, ttft_p{50,90,99}_ms, itl_p{50,90,99}_ms,
       peak_rss_mb, extra}  or  {label, system, experiment, workload, ..., error}
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ort_lora.bench import cluster, gguf_report, plan, plots, prefix_report, report

SCHEMA = 1
ROW_KEYS = (
    "label",
    "system",
    "experiment",
    "workload",
    "num_adapters",
    "output_tok_s",
    "requests_s",
    "cpu_s",
    "output_tok_per_cpu_s",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "itl_p90_ms",
    "itl_p99_ms",
    "peak_rss_mb",
)


def write_outputs(out: Path, results: list[dict], meta: dict, shapes: list[str]) -> list[Path]:
    """Write results.json, report.md and the plots into `out`; the paths written."""
    checks = report.targets(results, shapes) + gguf_report.targets(results)
    doc = {
        "schema": SCHEMA,
        "meta": meta,
        "results": results,
        "targets": [
            {"what": w, "measured": v, "measured_cpu": c, "goal": g} for w, v, c, g in checks
        ],
    }
    paths = [out / "results.json", out / "report.md"]
    paths[0].write_text(json.dumps(doc, indent=1))
    pngs = _plots(out, results, shapes)
    paths[1].write_text(markdown(doc, shapes, [p.name for p in pngs]))
    return paths + pngs


def _plots(out: Path, results: list[dict], shapes: list[str]) -> list[Path]:
    """The plots of the experiments that ran (none for one without rows)."""
    pngs = []
    for shape in shapes:
        rows = report.rows_of(results, f"systems/{shape}")
        title = f"{shape}: output tokens/s"
        if rows:
            path = out / f"systems_{shape}.png"
            pngs.append(plots.bar_plot(rows, "output_tok_s", title, "tok/s", path))
    pop = report.rows_of(results, "popularity")
    if pop:
        title, path = "adapter popularity", out / "popularity.png"
        pngs.append(plots.bar_plot(pop, "output_tok_s", title, "tok/s", path))
    reg = report.rows_of(results, "registered")
    if reg:
        title, path = "registered adapters", out / "registered.png"
        pngs.append(plots.line_plot(reg, "num_adapters", "output_tok_s", title, path))
    if trace := report.rows_of(results, "trace"):
        pngs.append(plots.latency_plot(trace, out / "trace_latency.png"))
    quant = [
        {**r, "label": f"{shape}: {r['label']}"}
        for shape in shapes
        for r in report.rows_of(results, f"quant/{shape}")
    ]
    if quant:
        title = "int4 base weights: output tokens/s"
        pngs.append(plots.bar_plot(quant, "output_tok_s", title, "tok/s", out / "quant.png"))
    scale = report.rows_of(results, "scale")
    if scale:
        title = "bigger model: output tokens/s"
        pngs.append(plots.bar_plot(scale, "output_tok_s", title, "tok/s", out / "scale.png"))
    grammar = report.rows_of(results, "grammar")
    if grammar:
        title = "structured outputs: step time by phase"
        pngs.append(plots.step_phases_plot(grammar, title, out / "grammar_steps.png"))
    pngs += cluster.plots_of(report.rows_of(results, "cluster"), out)
    if path := prefix_report.plot(results, out / "prefix.png"):
        pngs.append(path)
    return pngs


def _load(meta: dict, when: str) -> str:
    load = meta.get("loadavg_1_5_15", {}).get(when)
    return "-" if load is None else " ".join(f"{x:.1f}" for x in load)


def markdown(doc: dict, shapes: list[str], pngs: list[str]) -> str:
    """report.md: the command, the machine, the target checks, one table per experiment."""
    meta, results = doc["meta"], doc["results"]
    lines = [
        "# ort-lora bench results",
        "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}  ",
        f"Machine: {meta['cpu']} ({meta.get('isa', '?')}; {meta['machine']}), "
        f"{meta['threads']} intra-op threads per runtime  ",
        "Versions: "
        + ", ".join(
            f"{k} {v}"
            for k, v in {"onnxruntime": meta.get("onnxruntime"), **meta.get("peers", {})}.items()
        )
        + "  ",
        f"Load average (1/5/15 min) at start / end: {_load(meta, 'start')} / {_load(meta, 'end')}",
        "",
    ]
    lines += [f"- {n}" for n in meta.get("notes", [])]
    checks = [(t["what"], t["measured"], t["measured_cpu"], t["goal"]) for t in doc["targets"]]
    lines += ["", "## Targets", "", report.targets_table(checks), ""]
    for exp in _sections(shapes):
        rows = report.rows_of(results, exp)
        if rows and exp == "prefix":  # with the prefix cache's hit rate and its targets
            checks = prefix_report.targets_table(prefix_report.targets(results))
            lines += [f"## {exp}", "", prefix_report.table(rows), "", checks, ""]
        elif rows:
            lines += [f"## {exp}", "", report.table(rows), ""]
        if rows and exp == "grammar":
            lines += ["Step time at the most sequences, by engine phase:", ""]
            lines += [report.phases_table(rows), ""]
    lines += cluster.markdown(report.rows_of(results, "cluster"))
    lines += ["## Plots", ""] + [f"![{p}]({p})" for p in pngs]
    return "\n".join(lines) + "\n"


def _sections(shapes: list[str]) -> list[str]:
    """The plan's experiments in order, a shaped one once per shape; the cluster experiment
    has a section of its own (cluster.markdown)."""
    out = []
    for exp in plan.EXPERIMENTS:
        if exp in plan.SHAPED_EXPERIMENTS:
            out += [f"{exp}/{s}" for s in shapes]
        elif exp != "cluster":
            out.append(exp)
    return out


def rewrite(out: Path) -> list[Path]:
    """Write report.md and the plots again from out/results.json (after a report change)."""
    doc = json.loads((out / "results.json").read_text())
    shapes = [r["experiment"].split("/", 1)[1] for r in doc["results"] if "/" in r["experiment"]]
    shapes = list(dict.fromkeys(shapes)) or list(plan.FULL.shapes)  # as `ort-lora bench` passes
    return write_outputs(out, doc["results"], doc["meta"], shapes)


def main(argv: list[str] | None = None) -> int:
    """`python -m ort_lora.bench.output RESULTS_DIR`: rewrite a run's report and plots."""
    p = argparse.ArgumentParser(
        prog="python -m ort_lora.bench.output",
        description="Write report.md, the plots and the targets of an `ort-lora bench` run "
        "again from its results.json (after a change to the report).",
    )
    p.add_argument("results_dir", type=Path, help="the run's --out directory")
    args = p.parse_args(argv)
    if not (args.results_dir / "results.json").is_file():
        print(f"ort-lora bench output: {args.results_dir} has no results.json", file=sys.stderr)
        return 2
    try:
        paths = rewrite(args.results_dir)
    except (ValueError, KeyError, TypeError) as exc:  # JSON errors are ValueErrors
        where = args.results_dir / "results.json"
        print(
            f"ort-lora bench output: {where} is not a bench run's results: {exc!r}", file=sys.stderr
        )
        return 2
    print("\n".join(str(path) for path in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
