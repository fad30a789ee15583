"""ort-lora's LLMEngine driven step by step: requests join at their arrival times (continuous
batching), adapters mixed in every step."""

from __future__ import annotations

import time

from ort_lora.bench.metrics import RequestTimes
from ort_lora.bench.spec import RunSpec
from ort_lora.bench.workloads import Workload
from ort_lora.config import page_bytes


def build_engine(spec: RunSpec, workload: Workload):
    """An LLMEngine on the export with the default pool, max_loras and host adapter cache;
    spec.options["pool_bytes"] overrides the pool, spec.options["model"] the export (a key
    of spec.models, default "ort_lora"), spec.options["preload_adapters"] the preloading,
    spec.options["prefix_caching"] the prefix cache (default: EngineConfig's)."""
    from ort_lora.config import EngineConfig
    from ort_lora.engine.llm_engine import LLMEngine

    given = {}
    if "pool_bytes" in spec.options:
        given["pool_memory_bytes"] = spec.options["pool_bytes"]
    if "prefix_caching" in spec.options:
        given["enable_prefix_caching"] = spec.options["prefix_caching"]
    preload = spec.options.get("preload_adapters", True)
    config = EngineConfig(
        max_num_seqs=64, max_num_batched_tokens=2048, preload_adapters=preload, **given
    )
    model = spec.models[spec.options.get("model", "ort_lora")]
    return LLMEngine(model, config, intra_op_num_threads=spec.threads, seed=0)


def lora_requests(spec: RunSpec, workload: Workload) -> list:
    from ort_lora.lora_request import LoRARequest

    return [LoRARequest(f"a{i}", i + 1, spec.adapters[i]) for i in range(workload.num_adapters)]


def run(spec: RunSpec, workload: Workload) -> tuple[list[RequestTimes], dict]:
    engine = build_engine(spec, workload)
    loras = lora_requests(spec, workload)
    t0 = time.perf_counter()
    for lora in loras:
        engine.add_lora(lora)
    register_s = time.perf_counter() - t0
    _warm_up(engine, loras[0] if loras else None)
    cpu0 = time.process_time()
    times, steps = _drive(engine, workload, loras)
    extra = {"cpu_s": time.process_time() - cpu0, "register_s": register_s}
    extra["pool_mb"] = engine.num_pages * page_bytes(engine.manifest) / 2**20
    extra.update(_step_stats(steps))
    if spec.options.get("sgemm"):
        from ort_lora.bench.metrics import sgemm_gflops

        extra["sgemm_gflops"] = sgemm_gflops()
        extra["prefill_gflop"] = prefill_flops(engine.manifest, workload) / 1e9
        extra["run_s_total"] = sum(s.run_s for s in steps)
    return times, extra


def prefill_flops(m, workload: Workload) -> float:
    """Multiply-add FLOPs of running every prompt once: linear layers per token, causal
    attention per token pair, and the LM head on one row per sequence."""
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    per_token = (
        2
        * m.num_layers
        * (m.hidden_size * (2 * q + 2 * kv) + 3 * m.hidden_size * m.intermediate_size)
    )
    total = 0.0
    for r in workload.requests:
        s = len(r.prompt_ids)
        total += per_token * s + 2 * m.num_layers * 2 * q * s * (s + 1) / 2
        total += 2 * m.hidden_size * m.vocab_size
    return total


def _warm_up(engine, lora) -> None:
    from ort_lora.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i, req in enumerate([None, lora]):
        engine.add_request(f"warm{i}", [100, 101, 102, 103], params, req)
    while engine.has_unfinished_requests():
        engine.step()


def _drive(engine, workload: Workload, loras: list):
    from ort_lora.sampling_params import SamplingParams, StructuredOutputs

    reqs = sorted(enumerate(workload.requests), key=lambda ir: ir[1].arrival_s)
    times = [RequestTimes(r.arrival_s) for r in workload.requests]
    steps, nxt, t0 = [], 0, time.perf_counter()
    while nxt < len(reqs) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < len(reqs) and reqs[nxt][1].arrival_s <= now:
            i, r = reqs[nxt]
            spec = None if r.schema is None else StructuredOutputs(json=r.schema)
            params = SamplingParams(
                max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True, structured_outputs=spec
            )
            engine.add_request(str(i), list(r.prompt_ids), params, _lora_of(r, loras))
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, reqs[nxt][1].arrival_s - now))
            continue
        outs = engine.step()
        stamp = time.perf_counter() - t0
        steps.append(engine.times)
        for out in outs:
            got = times[int(out.request_id)].token_s
            got.extend([stamp] * (len(out.outputs[0].token_ids) - len(got)))
    return times, steps


def _lora_of(r, loras: list):
    """None, the request's adapter, or its composition (k adapters at weight 1/k)."""
    from dataclasses import replace

    if r.adapter is None or not r.compose:
        return None if r.adapter is None else loras[r.adapter]
    chosen = (r.adapter, *r.compose)
    return [replace(loras[a], weight=1.0 / len(chosen)) for a in chosen]


def _step_stats(steps) -> dict:
    """Host share of the steps that ran the most sequences (32 in the standard workloads)."""
    if not steps:
        return {}
    busiest = max(s.num_seqs for s in steps)
    full = [s for s in steps if s.num_seqs == busiest and s.num_tokens == busiest]
    full = full or [s for s in steps if s.num_seqs == busiest]
    host = sum(s.host_s for s in full)
    total = host + sum(s.run_s for s in full)
    return {
        "steps": len(steps),
        "host_share_at_max_seqs": host / total,
        "max_seqs": busiest,
        "step_ms_at_max_seqs": 1e3 * total / len(full),
        "host_ms": {  # per phase (ort_lora/timing.py); "run" is ONNX Runtime's
            k: 1e3 * sum(s.phases.get(k, 0.0) for s in full) / len(full)
            for k in sorted({k for s in full for k in s.phases})
        },
    }
