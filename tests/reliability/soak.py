"""Soak: `ort-lora serve` under a long mixed load with adapter churn (not part of `make test`).

    python tests/reliability/soak.py                       # tiny model, 10,000 requests
    python tests/reliability/soak.py --minutes 10          # as many as 10 minutes take
    python tests/reliability/soak.py --model smollm2 --requests 3000

Starts the server in its own process (so its RSS is its own), then `--concurrency` clients
send `--requests` requests (or as many as `--minutes` take): completions and chat, streamed
or not, greedy or sampled, n up to 3, on the base model, two fixed adapters, compositions of
them and a churn of adapters loaded and unloaded all the while (a request for one being
unloaded may get 404), plus a share of hostile requests (HOSTILE: every class that once
failed other requests or stalled the server). A process of its own polls /health every 50 ms
all the while. It reports requests by status, 5xx (must be 0), hangs (must be 0), innocent requests
failed (a normal request answered other than 200 / 404, or a stream ending in an error
event: must be 0), hostile requests let through (must be 0), /health answers other than 200
(must be 0: the engine never stopped) and its latency (p99 < 100 ms), pool pages by use
before and after (back to idle), RSS after warm-up and at the end (growth < 5 %), and whether
the fixed greedy prompt gave the same text on every adapter throughout. Prints the report
and saves it as JSON (--out, default docs/reliability/soak.json); exit 1 when a target is
missed.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from hostile_bodies import HealthPoller  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIXED = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
HI = [{"role": "user", "content": "hi"}]
HOSTILE = [
    {"prompt": "x", "seed": -1},
    {"prompt": "x", "top_k": 10**20},
    {"messages": HI, "chat_template": "{{ 1/0 }}"},
    {"prompt": "x", "max_tokens": 10**9},
    # float32 limits: finite as float64, not as what the kernel multiplies
    {"prompt": "x", "adapters": [{"name": "stable0", "weight": 1e308}]},
    {"prompt": "x", "adapters": [{"name": "stable0", "weight": 1e30}, {"name": "stable1"}]},
    {"prompt": "x", "adapters": [{"name": "stable0", "weight": True}, {"name": "stable1"}]},
    {"prompt": "x", "adapters": [{"name": "stable0", "weight": "1"}, {"name": "stable1"}]},
    # sizes: refused before any work
    {"prompt": "ab" * (3 << 20)},
    {"prompt": ["x" * 4096] * 1024},
    {"prompt": "x", "logit_bias": {str(i): 1 for i in range(50_000)}},
    {"prompt": "x", "logit_bias": {"\u0661\u0662": 1}},  # Arabic-Indic digits
    {"prompt": "x", "stop_token_ids": list(range(100_000))},
    {"messages": HI * 20_000},
    # templates (the server trusts request templates here): arithmetic, repetition, surrogates
    {"messages": HI, "chat_template": "{{ 'a' * 10**9 }}"},
    {"messages": HI, "chat_template": "{{ 7 ** 6000000 }}"},
    {"messages": HI, "chat_template": "{{ '\\ud800' }}"},  # jinja's escape: a lone surrogate
]
HEALTH_EVERY_S = 0.05


def build_assets(model: str, cache: Path) -> tuple[Path, Path]:
    """(exported model dir, adapter root with "stable0", "stable1", "churn0".."churn7")."""
    from ort_lora.bench.assets import ModelSource, ort_lora_model, random_adapters

    source = ModelSource(model)
    hf = source.hf_checkpoint(cache / model)
    model_dir = ort_lora_model(hf, cache / model, source.block_size)
    adapters = random_adapters(hf, cache / model, 2, rank=8, seed=0)
    root = cache / model / "soak_root"
    root.mkdir(exist_ok=True)
    names = ["stable0", "stable1"] + [f"churn{i}" for i in range(8)]
    for i, name in enumerate(names):
        if (root / name).is_symlink():  # an older soak linked them: files must be inside
            (root / name).unlink()
        if not (root / name).exists():
            shutil.copytree(adapters[i % 2], root / name)
    return model_dir, root


class Soak:
    def __init__(self, url: str, args):
        self.url, self.args = url, args
        self.codes: Counter = Counter()
        self.hangs = 0
        self.mismatches: list[str] = []
        self.loaded: set[str] = set()
        self.lock = threading.Lock()
        self.rng = random.Random(args.seed)
        self.stop = threading.Event()
        self.fixed: dict[str | None, str] = {}
        self.deadline = None if args.minutes is None else time.monotonic() + 60 * args.minutes
        self.sent = 0
        self.hostile_passed: list[str] = []
        self.innocent_failed: list[str] = []

    def fixed_texts(self) -> dict:
        out = {}
        for model in ["base", "stable0", "stable1"]:
            body = {**FIXED, "model": None if model == "base" else model}
            r = httpx.post(self.url + "/v1/completions", json=body, timeout=self.args.timeout)
            out[model] = r.json()["choices"][0]["text"] if r.status_code == 200 else r.status_code
        return out

    def check_fixed(self, when: str) -> None:
        now = self.fixed_texts()
        if now != self.fixed:
            self.mismatches.append(f"{when}: {now} != {self.fixed}")

    def one(self, i: int) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            return
        rng = random.Random(self.args.seed * 1_000_003 + i)
        body, path, hostile = self.request_body(rng)
        try:
            code, failed_in_band = self.send(path, body)
        except httpx.TimeoutException:
            with self.lock:
                self.hangs += 1
            return
        with self.lock:
            self.codes[code] += 1
            self.sent += 1
            if hostile and code < 400:
                self.hostile_passed.append(body_summary(body))
            if not hostile and (code not in (200, 404) or failed_in_band):
                self.innocent_failed.append(f"{code} {body_summary(body)}")
        if (i + 1) % 1000 == 0:
            self.check_fixed(f"after {i + 1} requests")
            print(f"soak: {i + 1} requests, {dict(self.codes)}", file=sys.stderr, flush=True)

    def run(self, pid: int) -> float:
        """Send the requests (in rounds of 1,000 until --requests or --minutes is reached);
        the server's RSS after the first round (the warm-up)."""
        rss_warm = None
        with ThreadPoolExecutor(self.args.concurrency) as pool:
            for start in range(0, self.args.requests, 1000):
                if self.deadline is not None and time.monotonic() > self.deadline:
                    break
                stop = min(start + 1000, self.args.requests)
                list(pool.map(self.one, range(start, stop)))
                rss_warm = rss_warm or rss_mib(pid)
        return rss_warm

    def send(self, path: str, body: dict) -> tuple[int, bool]:
        """(status, whether a stream ended with an error event)."""
        if not body.get("stream"):
            r = httpx.post(self.url + path, json=body, timeout=self.args.timeout)
            return r.status_code, False
        with httpx.stream("POST", self.url + path, json=body, timeout=self.args.timeout) as r:
            lines = list(r.iter_lines())
        return r.status_code, any(line.startswith('data: {"error"') for line in lines)

    def request_body(self, rng: random.Random) -> tuple[dict, str, bool]:
        """(body, path, hostile)."""
        if rng.random() < 0.05:
            body = dict(rng.choice(HOSTILE))
            chat = "messages" in body
            return body, "/v1/chat/completions" if chat else "/v1/completions", True
        with self.lock:
            churn = sorted(self.loaded)
        model = rng.choice([None, None, "stable0", "stable1", "stable0+stable1", *churn[:2]])
        body = {
            "model": model,
            "max_tokens": rng.randint(1, self.args.max_tokens),
            "temperature": rng.choice([0, 0.7, 1.0]),
            "n": rng.choice([1, 1, 1, 2, 3]),
            "stream": rng.random() < 0.3,
            "seed": rng.randrange(2**32),
        }
        if rng.random() < 0.5:
            body["messages"] = [{"role": "user", "content": f"Tell me about {rng.random():.5f}"}]
            return body, "/v1/chat/completions", False
        body["prompt"] = " ".join(rng.choice(["cat", "dog", "sky", "blue", "42"]) for _ in range(8))
        return body, "/v1/completions", False

    def churn(self) -> None:
        """Load and unload churn adapters while the load runs."""
        names = [f"churn{i}" for i in range(8)]
        while not self.stop.wait(self.args.churn_s):
            name = self.rng.choice(names)
            with self.lock:
                loaded = name in self.loaded
            action = "unload" if loaded else "load"
            body = {"lora_name": name} | ({} if loaded else {"lora_path": name})
            r = httpx.post(f"{self.url}/v1/{action}_lora_adapter", json=body, timeout=60)
            with self.lock:
                self.codes[f"{action} {r.status_code}"] += 1
                if r.status_code == 200:
                    (self.loaded.discard if loaded else self.loaded.add)(name)


def body_summary(body: dict) -> str:
    """A request body in at most 160 characters (hostile ones are large)."""
    text = json.dumps(body, ensure_ascii=True)
    return text if len(text) <= 160 else text[:157] + "..."


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pool_pages(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name == "ort_lora:pool_pages":
                out[s.labels["use"]] = s.value
    return out


def wait_idle(url: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pages = pool_pages(url)
        if pages.get("kv", 1) == 0:
            return pages
        time.sleep(0.5)
    return pool_pages(url)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    ap.add_argument("--requests", type=int, help="default 10,000; none with --minutes")
    ap.add_argument("--minutes", type=float, help="stop after this long (or --requests)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--churn-s", type=float, default=0.5, help="seconds between churn actions")
    ap.add_argument("--timeout", type=float, default=120.0, help="per request: past it, a hang")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "ort-lora-bench")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "reliability" / "soak.json")
    args = ap.parse_args(argv)
    if args.requests is None:
        args.requests = 10_000 if args.minutes is None else 10**9

    from ort_lora.bench.harness.servers import ServeProcess

    model_dir, root = build_assets(args.model, args.cache_dir)
    serve_args = [str(model_dir), "--adapter-root", str(root), "--log-level", "warning"]
    serve_args += ["--trust-request-chat-template"]
    serve_args += ["--lora-modules", f"stable0={root / 'stable0'}", f"stable1={root / 'stable1'}"]
    server = ServeProcess(serve_args)
    with server as url:
        pid = server.proc.pid
        soak = Soak(url, args)
        soak.fixed = soak.fixed_texts()
        idle_before = wait_idle(url)
        churner = threading.Thread(target=soak.churn, daemon=True)
        churner.start()
        with HealthPoller(url, period_s=HEALTH_EVERY_S, timeout_s=args.timeout) as health:
            started = time.monotonic()
            rss_warm = soak.run(pid)
            soak.stop.set()
            churner.join()
        elapsed = time.monotonic() - started
        rss_end = rss_mib(pid)
        for name in sorted(soak.loaded):  # unload the churn: pages back to idle
            httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)
        soak.check_fixed("at the end")
        idle_after = wait_idle(url)
    report = _report(args, soak, health, elapsed, rss_warm, rss_end, idle_before, idle_after)
    print(json.dumps(report, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["targets_met"] else 1


def _report(args, soak: Soak, health, elapsed, rss_warm, rss_end, idle_before, idle_after):
    codes = {str(k): v for k, v in sorted(soak.codes.items(), key=lambda kv: str(kv[0]))}
    five = sum(v for k, v in soak.codes.items() if str(k).split()[-1].startswith("5"))
    growth = (rss_end - rss_warm) / rss_warm
    report = {
        "command": " ".join(["python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "model": args.model,
        "requests": soak.sent,
        "concurrency": args.concurrency,
        "seconds": round(elapsed, 1),
        "codes": codes,
        "server_errors_5xx": five,
        "hangs": soak.hangs,
        "innocent_failed": soak.innocent_failed[:20],
        "hostile_let_through": soak.hostile_passed[:20],
        "health": health.summary(),
        "pool_pages_idle_before": idle_before,
        "pool_pages_idle_after": idle_after,
        "rss_mib_after_warmup": round(rss_warm, 1),
        "rss_mib_end": round(rss_end, 1),
        "rss_growth": round(growth, 4),
        "fixed_prompt_texts": soak.fixed,
        "fixed_prompt_mismatches": soak.mismatches,
    }
    report["targets_met"] = (
        five == 0
        and soak.hangs == 0
        and not soak.innocent_failed
        and not soak.hostile_passed
        and health.failures == 0
        and report["health"]["p99_ms"] < 100
        and idle_after.get("kv", 1) == 0
        and growth < 0.05
        and not soak.mismatches
    )
    return report


if __name__ == "__main__":
    sys.exit(main())
