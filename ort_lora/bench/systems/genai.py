"""onnxruntime-genai (PyPI), on its own model builder's export of the same checkpoint.

genai:           the base model, one static batch of all requests (its fastest setup here).
genai-multilora: ONNX Runtime's multi-LoRA as a user sets it up today: a graph whose LoRA
                 weights are overridable inputs, adapters loaded through `og.Adapters` from
                 .onnx_adapter files. One active adapter per generator, so requests are
                 grouped by adapter and the groups run one after another.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict

import numpy as np

from ort_lora.bench.metrics import RequestTimes
from ort_lora.bench.spec import RunSpec
from ort_lora.bench.workloads import BenchRequest, Workload


def load_model(path: str, threads: int):
    import onnxruntime_genai as og

    config = og.Config(path)
    options = {"intra_op_num_threads": threads, "inter_op_num_threads": 1}
    config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    return og.Model(config)


def run(spec: RunSpec, workload: Workload) -> tuple[list[RequestTimes], dict]:
    if any(r.arrival_s > 0 for r in workload.requests):
        raise ValueError(f"genai runs static batches; workload {workload.name!r} has arrivals")
    if spec.system == "genai":
        if workload.num_adapters:
            raise ValueError("system 'genai' serves the base model; use 'genai-multilora'")
        model = load_model(spec.models[spec.options.get("model", "genai_base")], spec.threads)
        _generate(model, workload.requests[:2])  # warm up
        cpu0 = time.process_time()
        stamps = _generate(model, workload.requests)
        extra = {"cpu_s": time.process_time() - cpu0}
        return _as_times(workload.requests, stamps, 0.0), extra
    return _run_grouped(spec, workload)


def _run_grouped(spec: RunSpec, workload: Workload):
    import onnxruntime_genai as og

    model = load_model(spec.models["genai_lora"], spec.threads)
    adapters = og.Adapters(model)
    for i in range(workload.num_adapters):
        adapters.load(spec.genai_adapters[i], f"a{i}")
    groups: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(workload.requests):
        groups[-1 if r.adapter is None else r.adapter].append(i)
    first = next(iter(groups))
    _generate(model, workload.requests[:2], adapters, None if first < 0 else f"a{first}")
    times: list[RequestTimes | None] = [None] * len(workload.requests)
    t0, cpu0 = time.perf_counter(), time.process_time()
    for a, idx in sorted(groups.items()):
        start = time.perf_counter() - t0
        reqs = [workload.requests[i] for i in idx]
        stamps = _generate(model, reqs, adapters, None if a < 0 else f"a{a}")
        for i, t in zip(idx, _as_times(reqs, stamps, start)):
            times[i] = t
    return times, {"cpu_s": time.process_time() - cpu0, "groups": len(groups)}


def _generate(model, requests: list[BenchRequest], adapters=None, name=None) -> list[float]:
    """One generator over `requests` (equal prompt lengths); the time of every new token."""
    import onnxruntime_genai as og

    lengths = {len(r.prompt_ids) for r in requests}
    if len(lengths) != 1:
        raise ValueError(f"genai static batches need equal prompt lengths, got {sorted(lengths)}")
    prompt, new = lengths.pop(), max(r.max_tokens for r in requests)
    params = og.GeneratorParams(model)
    params.set_search_options(
        max_length=prompt + new, min_length=prompt + new, do_sample=False, batch_size=len(requests)
    )
    t0 = time.perf_counter()
    gen = og.Generator(model, params)
    if name is not None:
        gen.set_active_adapter(adapters, name)
    gen.append_tokens(np.array([r.prompt_ids for r in requests], dtype=np.int32))  # [B, S]
    stamps = [time.perf_counter() - t0]  # append_tokens ran the prompt: the first token
    while not gen.is_done() and len(stamps) < new:
        gen.generate_next_token()
        stamps.append(time.perf_counter() - t0)
    return stamps


def _as_times(requests, stamps: list[float], start: float) -> list[RequestTimes]:
    return [RequestTimes(0.0, [start + s for s in stamps[: r.max_tokens]]) for r in requests]
