"""A request's output does not depend on what else the engine runs: greedy ids and logprobs
equal to the bit whether it runs alone, beside other requests (other adapters, other lengths),
with its prompt cut into chunked-prefill steps, or after a shared prefix came from the cache,
on float32 and int4 exports and every adapter row type (block size 8: every attention tile
spans cache blocks and new rows in ways that differ between those runs).
tests/test_paged_attention.py checks the same of the kernel with contexts long enough to be
split over threads."""

from __future__ import annotations

import numpy as np
import pytest

from ort_lora import LLM, LoRARequest, SamplingParams
from ort_lora.export.tiny import save_random_adapters

pytest.importorskip("peft")

_rng = np.random.default_rng(61)
PROMPT = _rng.integers(1, 250, 200).tolist()  # the tiny model: 256 positions
OTHERS = [_rng.integers(1, 250, n).tolist() for n in (5, 40, 233, 17, 90, 160)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)
ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all": dict(r=8, lora_alpha=16, target_modules="all-linear"),
}


@pytest.fixture(scope="module")
def adapter_dirs(hf_model, tmp_path_factory):
    return save_random_adapters(hf_model, tmp_path_factory.mktemp("invariance"), ADAPTERS, 61)


def _target(llm, lora, others=(), other_loras=()):
    """The output of PROMPT under lora, generated in one generate() with `others`."""
    outs = llm.generate([PROMPT, *others], GREEDY, [lora, *other_loras])
    return outs[0].outputs[0]


def _scores(out) -> list:
    return [
        (t, {k: v.logprob for k, v in lp.items()}) for t, lp in zip(out.token_ids, out.logprobs)
    ]


@pytest.fixture(scope="module")
def models(tiny_row_exports, tiny_quant_export) -> dict:
    """Exports by base weights and adapter row type (16-bit and int8 rows are converted as
    the kernels load them; the baseline kernels widen long segments' rows first)."""
    rows = {f"float32, {t} rows": tiny_row_exports[t] for t in ("bfloat16", "float16", "int8")}
    return {"float32": tiny_row_exports["float32"], "int4": tiny_quant_export("int4", 4), **rows}


KINDS = ["float32", "int4", "float32, bfloat16 rows", "float32, float16 rows", "float32, int8 rows"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_request_gets_the_same_bits_whatever_runs_beside_it(kind, models, adapter_dirs):
    model = models[kind]
    loras = [LoRARequest(n, i + 1, str(d)) for i, (n, d) in enumerate(adapter_dirs.items())]
    config = dict(num_pages=512, max_loras=2)
    for lora in (None, loras[1]):
        alone = _scores(_target(LLM(model, enable_prefix_caching=False, **config), lora))
        crowded = LLM(model, enable_prefix_caching=False, **config)
        others = [loras[i % 2] if i % 3 else None for i in range(len(OTHERS))]
        assert _scores(_target(crowded, lora, OTHERS, others)) == alone
        chunked = LLM(model, enable_prefix_caching=False, max_num_batched_tokens=64, **config)
        assert _scores(_target(chunked, lora, OTHERS[:2], others[:2])) == alone
        cached = LLM(model, **config)
        _target(cached, lora)  # leaves PROMPT's blocks in the cache
        assert _scores(_target(cached, lora, OTHERS[2:], others[2:])) == alone
