"""The gguf experiment's results: ort-lora / llama.cpp on the same Q4_1 GGUF and adapters,
per workload, by wall clock (output tok/s) and by CPU time (output tokens per CPU-second of
the server), and QuantMatMul / MatMulNBits one request at a time; written as gguf.md (with
the llama.cpp version and the CPU's ISA) and gguf.png beside report.md.

Each row ran once per round (plan.GGUF_ROWS, alternated); a ratio is that of the two
systems' fastest runs (the least disturbed on a shared machine), and the per-round ratios
show its spread.

    python -m ort_lora.bench.gguf_report RESULTS_DIR [MORE ...] [--out DIR]
                                      # gguf.md and gguf.png again (of several runs' rounds)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ort_lora.bench import report

EXPERIMENT = "gguf"
OURS, THEIRS, NBITS = "ort-lora", "llama.cpp", "ort-lora MatMulNBits"  # plan.GGUF_ROWS labels


def rows_of(results: list[dict]) -> list[dict]:
    return [r for r in results if r["experiment"] == EXPERIMENT]


def runs(results: list[dict], label: str) -> list[dict]:
    """The successful runs of a row, in round order (the order they ran)."""
    return [r for r in rows_of(results) if r["label"] == label and "error" not in r]


def _tries(results: list[dict], label: str) -> list[dict | None]:
    """Every run of a row in round order, None for a failed one (rounds stay paired)."""
    return [None if "error" in r else r for r in rows_of(results) if r["label"] == label]


def best(results: list[dict], label: str) -> dict | None:
    return max(runs(results, label), key=lambda r: r["output_tok_s"], default=None)


def workloads(results: list[dict]) -> list[str]:
    """The workload names, in the order they ran ("<system>: <workload>" labels)."""
    names = [r["label"].split(": ", 1)[1] for r in rows_of(results) if ": " in r["label"]]
    return list(dict.fromkeys(names))


def _ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    if a is None or b is None or not b.get(key):
        return None
    return a[key] / b[key]


def ratios(results: list[dict], ours: str = OURS, theirs: str = THEIRS) -> list[dict]:
    """Per workload both systems' best runs (None: no successful run) and ours / theirs:
    tok/s, tok/CPU-s, and tok/s of each round (runs of the same round compared)."""
    out = []
    for name in workloads(results):
        a, b = best(results, f"{ours}: {name}"), best(results, f"{theirs}: {name}")
        pairs = zip(_tries(results, f"{ours}: {name}"), _tries(results, f"{theirs}: {name}"))
        out.append(
            dict(
                workload=name,
                ours=a,
                theirs=b,
                tok_s=_ratio(a, b, "output_tok_s"),
                tok_cpu_s=_ratio(a, b, "output_tok_per_cpu_s"),
                rounds=[_ratio(x, y, "output_tok_s") for x, y in pairs],
            )
        )
    return out


def _num(row: dict | None, key: str, fmt: str) -> str:
    return "-" if row is None or row.get(key) is None else fmt.format(row[key])


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _pair(a: dict | None, b: dict | None, key: str, fmt: str) -> str:
    return f"{_num(a, key, fmt)} / {_num(b, key, fmt)}"


def _rss(a: dict | None, b: dict | None) -> str:
    """Peak RSS of both, ort-lora's with the page pool it sizes at start (KV and adapter
    rows; llama.cpp's KV cache is -np x the slot's context)."""
    pool = None if a is None else a.get("extra", {}).get("pool_mb")
    ours = _num(a, "peak_rss_mb", "{:.0f}") + ("" if pool is None else f" (pool {pool:.0f})")
    return f"{ours} / {_num(b, 'peak_rss_mb', '{:.0f}')}"


def table(results: list[dict]) -> str:
    """Markdown: one line per workload, ort-lora's and llama.cpp's numbers and their ratio
    (latency and memory as "ort-lora / llama.cpp")."""
    head = ["workload", "ort-lora tok/s", "llama.cpp tok/s", "ratio", "ratio per round",
            "ort-lora tok/CPU-s", "llama.cpp tok/CPU-s", "ratio", "TTFT p50 ms",
            "ITL p50 ms", "peak RSS MiB"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in ratios(results):
        a, b = r["ours"], r["theirs"]
        cells = [
            r["workload"],
            _num(a, "output_tok_s", "{:.1f}"),
            _num(b, "output_tok_s", "{:.1f}"),
            _x(r["tok_s"]),
            ", ".join(_x(v) for v in r["rounds"]) or "-",
            _num(a, "output_tok_per_cpu_s", "{:.1f}"),
            _num(b, "output_tok_per_cpu_s", "{:.1f}"),
            _x(r["tok_cpu_s"]),
            _pair(a, b, "ttft_p50_ms", "{:.0f}"),
            _pair(a, b, "itl_p50_ms", "{:.1f}"),
            _rss(a, b),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def nbits(results: list[dict]) -> dict | None:
    """QuantMatMul / MatMulNBits (ort-lora's two int4 linear ops) on the workload the
    MatMulNBits row ran, or None."""
    names = [n for n in workloads(results) if best(results, f"{NBITS}: {n}") is not None]
    if not names:
        return None
    q, n = best(results, f"{OURS}: {names[0]}"), best(results, f"{NBITS}: {names[0]}")
    return dict(
        workload=names[0],
        quantmatmul=q,
        matmulnbits=n,
        tok_s=_ratio(q, n, "output_tok_s"),
        tok_cpu_s=_ratio(q, n, "output_tok_per_cpu_s"),
    )


def targets(results: list[dict]) -> list[tuple]:
    """(what, wall-clock ratio, CPU-time ratio, None) per workload, for the report's targets: the
    comparisons have no goal."""
    out = [
        (f"gguf {r['workload']}: ort-lora / llama.cpp", r["tok_s"], r["tok_cpu_s"], None)
        for r in ratios(results)
    ]
    if (n := nbits(results)) is not None:
        what = f"gguf {n['workload']}: ort-lora QuantMatMul / MatMulNBits"
        out.append((what, n["tok_s"], n["tok_cpu_s"], None))
    return out


def llama_cpp_version(results: list[dict]) -> str:
    """The llama.cpp source and version its runs recorded ("-" without a successful run)."""
    for r in runs_of_system(results, "llama-cpp"):
        e = r.get("extra", {})
        return f"{e.get('llama_cpp_source', '?')} (llama-server {e.get('llama_cpp_version', '?')})"
    return "-"


def runs_of_system(results: list[dict], system: str) -> list[dict]:
    return [r for r in rows_of(results) if r["system"] == system and "error" not in r]


def markdown(results: list[dict], meta: dict) -> str:
    """gguf.md: what ran where, the ratio table, the int4 op comparison, every run."""
    lines = [
        "# ort-lora and llama.cpp on the same Q4_1 GGUF",
        "",
        f"Command: `{meta.get('command', '?')}`  ",
        f"Date: {meta.get('date', '?')}  ",
        f"Machine: {meta.get('cpu', '?')} ({meta.get('isa', '?')}; {meta.get('machine', '?')}), "
        f"{meta.get('threads', '?')} threads per system  ",
        f"llama.cpp: {llama_cpp_version(results)}",
        "",
        *[f"- {n}" for n in meta.get("notes", [])],
        "",
        "ort-lora / llama.cpp, each the fastest of its rounds (TTFT, ITL and peak RSS: "
        "ort-lora / llama.cpp):",
        "",
        table(results),
        "",
    ]
    if (n := nbits(results)) is not None:
        q, m = n["quantmatmul"], n["matmulnbits"]
        lines += [
            f"ort-lora's int4 linears, {n['workload']}: QuantMatMul "
            f"{_num(q, 'output_tok_s', '{:.1f}')} tok/s, MatMulNBits "
            f"{_num(m, 'output_tok_s', '{:.1f}')} tok/s: {_x(n['tok_s'])} "
            f"({_x(n['tok_cpu_s'])} per CPU-second)",
            "",
        ]
    lines += ["Every run:", "", report.table(rows_of(results)), "", "![gguf](gguf.png)", ""]
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> Path | None:
    """Output tok/s and tok/CPU-s per workload, one bar per system (best run); None (no
    file) without rows."""
    from ort_lora.bench.plots import _plt

    names = workloads(results)
    labels = [OURS, NBITS, THEIRS]
    if not names:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.27
    for ax, key, ylabel in zip(
        axes, ("output_tok_s", "output_tok_per_cpu_s"), ("output tok/s", "output tok/CPU-s")
    ):
        for j, label in enumerate(labels):
            vals = [best(results, f"{label}: {n}") for n in names]
            heights = [0 if v is None else v[key] for v in vals]
            if any(heights):
                ax.bar(
                    [i + (j - 1) * width for i in range(len(names))], heights, width, label=label
                )
        ax.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.suptitle("ort-lora (int4 from the GGUF) and llama.cpp, same Q4_1 GGUF and adapters")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write(out: Path, results: list[dict], meta: dict) -> str:
    """Write gguf.md and gguf.png into `out`; the summary `ort-lora bench` prints."""
    plot(results, out / "gguf.png")
    (out / "gguf.md").write_text(markdown(results, meta))
    head = f"\nllama.cpp: {llama_cpp_version(results)}; CPU ISA: {meta.get('isa', '?')}\n"
    return head + table(results) + f"\n-> {out}/gguf.md, gguf.png\n"


def main(argv: list[str] | None = None) -> int:
    """gguf.md and gguf.png of a run again; given several runs of the gguf experiment, of all
    their rounds together (the first run's meta), into --out."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m ort_lora.bench.gguf_report", description=__doc__)
    p.add_argument("results_dirs", nargs="+", type=Path, help="--out directories of gguf runs")
    p.add_argument("--out", type=Path, help="where to write (default: the first directory)")
    args = p.parse_args(argv)
    missing = [d for d in args.results_dirs if not (d / "results.json").is_file()]
    if missing:
        print(f"gguf_report: {missing[0]} has no results.json", file=sys.stderr)
        return 2
    docs = [json.loads((d / "results.json").read_text()) for d in args.results_dirs]
    meta = dict(docs[0]["meta"])
    if len(docs) > 1:
        dates = ", ".join(d["meta"]["date"] for d in docs)
        meta["notes"] = [*meta.get("notes", []), f"the rounds of {len(docs)} runs ({dates})"]
    out = args.out or args.results_dirs[0]
    out.mkdir(parents=True, exist_ok=True)
    print(write(out, [r for d in docs for r in d["results"]], meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
