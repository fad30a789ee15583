"""Hugging Face transformers (+ PEFT): one static batch of all requests, as S-LoRA and Punica
compare against. With adapters: every adapter loaded into one PeftModel and the batch mixed
with `generate(adapter_names=[...])` ("__base__" = no adapter). Without: the bare model."""

from __future__ import annotations

import time

from ort_lora.bench.metrics import RequestTimes
from ort_lora.bench.spec import RunSpec
from ort_lora.bench.workloads import Workload


def load_model(spec: RunSpec, workload: Workload):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec.threads)
    model = AutoModelForCausalLM.from_pretrained(spec.models["hf"], dtype=torch.float32)
    if workload.num_adapters == 0:
        return model.eval()
    from peft import PeftModel

    model = PeftModel.from_pretrained(model, spec.adapters[0], adapter_name="a0")
    for i in range(1, workload.num_adapters):
        model.load_adapter(spec.adapters[i], adapter_name=f"a{i}")
    return model.eval()


def run(spec: RunSpec, workload: Workload) -> tuple[list[RequestTimes], dict]:
    if any(r.arrival_s > 0 for r in workload.requests):
        raise ValueError(
            f"transformers runs static batches; workload {workload.name!r} has arrivals"
        )
    model = load_model(spec, workload)
    _generate(model, workload.requests[:2], workload.num_adapters > 0)  # warm up
    cpu0 = time.process_time()
    stamps = _generate(model, workload.requests, workload.num_adapters > 0)
    extra = {"cpu_s": time.process_time() - cpu0}
    return [RequestTimes(0.0, stamps[: r.max_tokens]) for r in workload.requests], extra


def _generate(model, requests, mixed: bool) -> list[float]:
    """Generate for `requests` as one left-padded batch; the time of every decoding step."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    width = max(len(r.prompt_ids) for r in requests)
    ids = torch.zeros((len(requests), width), dtype=torch.long)  # [B, S]
    mask = torch.zeros_like(ids)
    for b, r in enumerate(requests):
        ids[b, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[b, width - len(r.prompt_ids) :] = 1
    new = max(r.max_tokens for r in requests)
    stamps: list[float] = []
    t0 = time.perf_counter()

    class Stamp(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            stamps.append(time.perf_counter() - t0)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    kwargs = {}
    if mixed:
        kwargs["adapter_names"] = [
            "__base__" if r.adapter is None else f"a{r.adapter}" for r in requests
        ]
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([Stamp()]),
            **kwargs,
        )
    return stamps
