"""Target ratios of several `ort-lora bench` runs side by side, with their medians per variant.

One bench run measures each row once, and on a shared machine a row's speed moves from run to
run (its peer's too), so a ratio is read from several runs that alternate the variants being
compared. Pass the runs' output directories; a directory's name up to its last "-" is its
variant (quant-vnni/splits-q1, quant-vnni/splits-q2, ... are variant splits):

    python bench/collect_targets.py docs/bench/quant-vnni/*-q[123] --match int4 \\
        --out docs/bench/quant-vnni/summary-quiet

Prints, per target whose name contains --match, every run's wall and CPU ratio and the median
per variant; writes summary.json and summary.png (one panel per target, a dot per run, a bar
at each variant's median) to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def load_runs(dirs: list[Path]) -> list[dict]:
    runs = []
    for d in sorted(dirs):
        path = d / "results.json"
        if not path.is_file():
            continue
        doc = json.loads(path.read_text())
        variant = d.name.rsplit("-", 1)[0] if "-" in d.name else d.name
        targets = {t["what"]: t for t in doc["targets"] if t.get("measured") is not None}
        runs.append({"dir": str(d), "variant": variant, "date": doc["meta"]["date"],
                     "targets": targets})  # fmt: skip
    return runs


def summarize(runs: list[dict], match: str) -> dict:
    """target -> variant -> {"wall": [...], "cpu": [...], "median_wall", "median_cpu", "goal"}."""
    out: dict = {}
    for run in runs:
        for what, t in run["targets"].items():
            if match not in what:
                continue
            v = out.setdefault(what, {}).setdefault(run["variant"], {"wall": [], "cpu": []})
            v["wall"].append(t["measured"])
            v["cpu"].append(t.get("measured_cpu"))
            v["goal"] = t["goal"]
    for variants in out.values():
        for v in variants.values():
            v["median_wall"] = statistics.median(v["wall"])
            cpu = [c for c in v["cpu"] if c is not None]
            v["median_cpu"] = statistics.median(cpu) if cpu else None
    return out


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(summary))
    rows = -(-len(summary) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    for ax in axes.flat[len(summary) :]:
        ax.set_visible(False)
    for ax, (what, variants) in zip(axes.flat, summary.items()):
        names = list(variants)
        for i, name in enumerate(names):
            v = variants[name]
            ax.bar(i, v["median_wall"], color="#9ecae1", width=0.6)
            ax.plot([i] * len(v["wall"]), v["wall"], "o", color="#08519c", markersize=4)
        goal = next(iter(variants.values()))["goal"]
        if goal is not None:
            ax.axhline(goal, color="#d62728", linestyle="--", linewidth=1, label=f"goal {goal}")
            ax.legend(fontsize=7)
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ax.set_title(what, fontsize=8)
    for row in axes:
        row[0].set_ylabel("ratio (wall; bar: median, dots: runs)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dirs", nargs="+", type=Path, help="ort-lora bench output directories")
    p.add_argument("--match", default="", help="only targets whose name contains this")
    p.add_argument("--out", type=Path, help="directory for summary.json and summary.png")
    args = p.parse_args(argv)
    runs = load_runs(args.dirs)
    if not runs:
        p.error("no results.json in the given directories")
    summary = summarize(runs, args.match)
    for what, variants in summary.items():
        print(f"\n{what} (goal {next(iter(variants.values()))['goal']})")
        for name, v in variants.items():
            walls = ", ".join(f"{w:.2f}" for w in v["wall"])
            cpus = ", ".join("-" if c is None else f"{c:.2f}" for c in v["cpu"])
            cpu_med = "-" if v["median_cpu"] is None else f"{v['median_cpu']:.2f}"
            print(f"  {name:<16} median wall {v['median_wall']:.2f}  CPU {cpu_med}"
                  f"   runs wall [{walls}]  CPU [{cpus}]")  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        doc = {"runs": [{k: r[k] for k in ("dir", "variant", "date")} for r in runs]}
        (args.out / "summary.json").write_text(json.dumps(doc | {"targets": summary}, indent=1))
        plot(summary, args.out / "summary.png")
        print(f"\nwrote {args.out / 'summary.json'}, {args.out / 'summary.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
