"""Where an ort-lora run's time goes: `python -m ort_lora.bench.profile SPEC.json [OUT_DIR]`.

Runs one saved ort-lora spec (docs/bench/specs/NN-*.json) with ONNX Runtime's profiler on and
prints the time per op type (MatMul, LoraSGMV, PagedAttention, ...) over the measured steps,
next to the engine's host time (schedule, inputs, postprocess), and each LoraSGMV node's time
per call (the median over the run, one row for the same node of every layer). Saves ORT's
trace JSON and a summary JSON in OUT_DIR (default: the spec's directory).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from ort_lora.bench.spec import RunSpec


def op_times(trace: list[dict]) -> dict[str, float]:
    """Seconds per op type from an ORT profile trace (kernel events, all runs)."""
    per_op: dict[str, float] = defaultdict(float)
    for event in trace:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            per_op[event["args"].get("op_name", "?")] += event["dur"] / 1e6
    return dict(sorted(per_op.items(), key=lambda kv: -kv[1]))


def node_calls(trace: list[dict], op: str) -> dict[str, dict]:
    """Per node of op type `op`, its layer index taken out of the name (one row for all
    layers' q/k/v nodes, say): calls, median and mean microseconds per call."""
    per_node: dict[str, list[float]] = defaultdict(list)
    for event in trace:
        if event.get("cat") != "Node" or event["args"].get("op_name") != op:
            continue
        if event["name"].endswith("_kernel_time"):
            name = re.sub(r"layers\.\d+", "layers.*", event["name"][: -len("_kernel_time")])
            per_node[name].append(event["dur"])
    return {
        name: {"calls": len(d), "median_us": statistics.median(d), "mean_us": statistics.mean(d)}
        for name, d in sorted(per_node.items())
    }


def profile(spec: RunSpec, out_dir: Path) -> dict:
    """Run `spec` (an ort-lora system) with ORT profiling; the op-time summary."""
    import ort_lora
    from ort_lora.bench.systems import ort_lora_engine

    if spec.system != "ort-lora":
        raise ValueError(f"profile runs ort-lora specs; this one is {spec.system!r}")
    plain = ort_lora.session_options

    def profiled(**config):
        opts = plain(**config)
        opts.enable_profiling = True
        opts.profile_file_prefix = str(out_dir / "ort_profile")
        return opts

    engines = []
    build = ort_lora_engine.build_engine
    ort_lora.session_options = profiled
    ort_lora_engine.build_engine = lambda s, w: engines.append(build(s, w)) or engines[-1]
    times, extra = ort_lora_engine.run(spec, spec.load)
    # one trace per graph: the export's, and the base graph's (steps without adapters)
    paths = [Path(g.session.end_profiling()) for g in engines[0].runner.session.graphs]
    trace = [event for path in paths for event in json.loads(path.read_text())]
    ops, lora = op_times(trace), node_calls(trace, "LoraSGMV")
    return {"label": spec.label, "trace": [str(p) for p in paths], "op_s": ops,
            "lora_nodes": lora, "extra": extra}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ort_lora.bench.profile",
        description="Rerun one saved ort-lora spec with ONNX Runtime's profiler; time per op type.",
    )
    p.add_argument("spec", type=Path, help="a saved spec, e.g. docs/bench/specs/00-*.json")
    p.add_argument("out_dir", type=Path, nargs="?", help="default: the spec's directory")
    args = p.parse_args(argv)
    spec_path = args.spec
    try:
        spec = RunSpec.read(spec_path)
    except (OSError, ValueError, TypeError) as exc:  # missing, not JSON, not a spec's fields
        print(f"ort-lora bench profile: cannot read the spec {spec_path}: {exc}", file=sys.stderr)
        return 2
    if spec.system != "ort-lora":
        print(f"ort-lora bench profile: {spec_path} is a {spec.system!r} spec; "
              "profile runs ort-lora specs", file=sys.stderr)  # fmt: skip
        return 2
    out_dir = args.out_dir or spec_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = profile(spec, out_dir)
    total = sum(summary["op_s"].values())
    print(f"{summary['label']}: ORT kernel time {total:.2f} s (warm-up steps included)")
    for op, s in list(summary["op_s"].items())[:12]:
        print(f"  {op:32s} {s:8.3f} s  {100 * s / total:5.1f} %")
    for name, c in summary["lora_nodes"].items():
        print(f"  {name:60s} {c['calls']:6d} calls, {c['median_us']:7.1f} us median per call")
    host = summary["extra"].get("host_ms", {})
    print("  per step at max seqs (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in host.items()))
    (out_dir / f"{spec_path.stem}.profile.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
