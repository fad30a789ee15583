"""ort-lora's LLMEngine on a chat trace (bench/prefix.py): the clients of chat_loop.py, each
next turn sent when the previous one finished; the run's prefix-cache hits from each
RequestOutput's num_cached_tokens. spec.options["prefix_caching"] turns the engine's prefix
cache on or off (EngineConfig.enable_prefix_caching)."""

from __future__ import annotations

import time

from ort_lora.bench.metrics import RequestTimes
from ort_lora.bench.spec import RunSpec
from ort_lora.bench.systems import chat_loop
from ort_lora.bench.workloads import Workload


def run(spec: RunSpec, workload: Workload) -> tuple[list[RequestTimes], dict]:
    from ort_lora.bench.systems.ort_lora_engine import _warm_up, build_engine, lora_requests
    from ort_lora.config import page_bytes
    from ort_lora.sampling_params import SamplingParams

    engine = build_engine(spec, workload)
    loras = lora_requests(spec, workload)
    for lora in loras:
        engine.add_lora(lora)
    _warm_up(engine, loras[0] if loras else None)

    def submit(rid: str, ids: list[int], max_tokens: int, adapter: int | None) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(rid, ids, params, None if adapter is None else loras[adapter])

    def step():
        return [
            (o.request_id, o.outputs[0].token_ids, o.finished, o.num_cached_tokens)
            for o in engine.step()
        ]

    report = chat_loop.progress_printer(spec.label)
    cpu0 = time.process_time()
    got = chat_loop.drive(spec.workload, submit, step, engine.has_unfinished_requests, report)
    extra = {"cpu_s": time.process_time() - cpu0, **chat_loop.cache_stats(got)}
    extra["prefix_caching"] = engine.config.enable_prefix_caching
    extra["pool_mb"] = engine.num_pages * page_bytes(engine.manifest) / 2**20
    times = [RequestTimes(s, t) for s, t in zip(got["sent_s"], got["token_s"], strict=True)]
    return times, extra
