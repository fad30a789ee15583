"""PNG plots of a benchmark run (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bar_plot(rows: list[dict], key: str, title: str, ylabel: str, path: Path) -> Path:
    """One bar per run (label), height = row[key]; failed runs are left out."""
    plt = _plt()
    ok = [r for r in rows if "error" not in r and r.get(key) is not None]
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(ok) + 2), 4))
    ax.bar(range(len(ok)), [r[key] for r in ok], color="tab:blue")
    ax.set_xticks(range(len(ok)), [r["label"] for r in ok], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def line_plot(rows: list[dict], x: str, y: str, title: str, path: Path) -> Path:
    """Throughput against a numeric field (e.g. registered adapters), log x."""
    plt = _plt()
    ok = sorted((r for r in rows if "error" not in r), key=lambda r: r[x])
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([r[x] for r in ok], [r[y] for r in ok], marker="o")
    ax.set_xscale("log")
    ax.set_xlabel(x.replace("_", " "))
    ax.set_ylabel(y.replace("_", " "))
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def latency_plot(rows: list[dict], path: Path) -> Path:
    """TTFT and ITL percentiles (p50, p90, p99) of each run, grouped bars."""
    plt = _plt()
    ok = [r for r in rows if "error" not in r]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, metric in zip(axes, ("ttft", "itl")):
        for j, p in enumerate((50, 90, 99)):
            vals = [r.get(f"{metric}_p{p}_ms") or 0 for r in ok]
            ax.bar([i + 0.25 * j for i in range(len(ok))], vals, width=0.25, label=f"p{p}")
        ax.set_xticks([i + 0.25 for i in range(len(ok))], [r["label"] for r in ok], fontsize=8)
        ax.set_ylabel(f"{metric.upper()} ms")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def step_phases_plot(rows: list[dict], title: str, path: Path) -> Path:
    """Mean step time at the run's most sequences, stacked by engine phase (ort_lora/timing.py:
    "run" is ONNX Runtime's), one bar per run."""
    plt = _plt()
    ok = [r for r in rows if "error" not in r and "host_ms" in r.get("extra", {})]
    phases = sorted({k for r in ok for k in r["extra"]["host_ms"]}, key=lambda k: k != "run")
    fig, ax = plt.subplots(figsize=(max(5, 1.1 * len(ok) + 3), 4))
    bottom = [0.0] * len(ok)
    for phase in phases:
        vals = [r["extra"]["host_ms"].get(phase, 0.0) for r in ok]
        ax.bar(range(len(ok)), vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(ok)), [r["label"] for r in ok], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per step")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def latency_and_rate_plot(rows: list[dict], marked: list[bool], title: str, path: Path) -> Path:
    """TTFT p50 (log scale) and output tok/s of each run side by side, marked runs green and
    the others gray."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(max(9, 1.2 * len(rows) + 4), 4.5))
    colors = ["tab:green" if m else "tab:gray" for m in marked]
    for ax, key in zip(axes, ("ttft_p50_ms", "output_tok_s"), strict=True):
        ax.bar(range(len(rows)), [r[key] for r in rows], color=colors)
        ticks = [r["label"] for r in rows]
        ax.set_xticks(range(len(rows)), ticks, rotation=35, ha="right", fontsize=7)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("TTFT p50 ms (log scale)")
    axes[1].set_ylabel("output tokens/s")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
