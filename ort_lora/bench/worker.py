"""One benchmark run in its own process: `python -m ort_lora.bench.worker SPEC.json OUT.json`.

Runs spec.system on spec.workload and writes {label, system, experiment, workload, metrics...,
peak_rss_mb, extra} to OUT.json; on failure {..., "error": message} and exit status 1.
A fresh process per run keeps systems from sharing caches, threads or allocator state, and
makes peak RSS that run's own.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from pathlib import Path

from ort_lora.bench.metrics import peak_rss_mb, summarize
from ort_lora.bench.spec import RunSpec
from ort_lora.bench.systems import CHAT_RUNNERS, RUNNERS


def run_spec(spec: RunSpec) -> dict:
    """Run one spec in this process; the result row (metrics + peak memory + extras)."""
    if spec.system not in RUNNERS:
        raise ValueError(f"unknown system {spec.system!r}; expected one of {sorted(RUNNERS)}")
    workload = spec.load
    chat = CHAT_RUNNERS if "chat" in spec.workload else {}  # turns wait on earlier outputs
    runner = importlib.import_module(chat.get(spec.system, RUNNERS[spec.system]))
    load_start = os.getloadavg()
    times, extra = runner.run(spec, workload)
    row = summarize(times, workload.expected_tokens)
    row["loadavg_start"], row["loadavg_end"] = load_start, os.getloadavg()
    row["peak_rss_mb"] = extra.pop("server_peak_rss_mb", None) or peak_rss_mb()
    # CPU seconds of the system during the measured part: robust to other jobs on the machine
    row["cpu_s"] = extra.pop("cpu_s")
    row["output_tok_per_cpu_s"] = row["output_tokens"] / row["cpu_s"]
    row["extra"] = extra
    return row


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m ort_lora.bench.worker SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = RunSpec.read(Path(argv[0]))
    head = {
        "label": spec.label,
        "system": spec.system,
        "experiment": spec.experiment,
        "workload": spec.load.name,
        "num_requests": len(spec.load.requests),
        "num_adapters": spec.load.num_adapters,
    }
    try:
        row = {**head, **run_spec(spec)}
        status = 0
    except Exception as exc:  # the parent reports it in the table and goes on
        traceback.print_exc()
        row = {**head, "error": f"{type(exc).__name__}: {exc}"}
        status = 1
    Path(argv[1]).write_text(json.dumps(row, indent=1))
    return status


if __name__ == "__main__":
    sys.exit(main())
