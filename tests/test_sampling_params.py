"""SamplingParams, LoRARequest and output value types: validation names the field and range."""

from __future__ import annotations

import pytest

from ort_lora.errors import RequestError
from ort_lora.lora_request import LoRARequest
from ort_lora.outputs import CompletionOutput, Logprob, RequestOutput
from ort_lora.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0}, "n must be >= 1"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k must be -1 or 0"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
        ({"logprobs": -1}, "logprobs must be >= 0"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be >= 0"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"stop": ["ok", ""]}, "stop must hold non-empty strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"temperature": "hot"}, "temperature must be a finite number"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be a finite number"),
        ({"top_p": float("nan")}, "top_p must be a finite number"),
        ({"seed": -1}, "seed must be >= 0"),
        ({"seed": 2**64}, "seed must be <= 18446744073709551615"),
        ({"top_k": 2**63}, "top_k must be <= 9223372036854775807"),
        ({"stop": 5}, "stop must be a string or a list"),
        ({"stop_token_ids": 7}, "stop_token_ids must be a list"),
    ],
)
def test_invalid_fields_are_named(kwargs, message):
    with pytest.raises(RequestError, match=message) as info:
        SamplingParams(**kwargs)
    assert info.value.param == next(iter(kwargs))


def test_seed_range_is_numpy_s():
    """0 .. 2^64 - 1, as vLLM's API: every one makes a generator."""
    from ort_lora.engine.sampler import make_generator

    for seed in (0, 2**64 - 1):
        assert make_generator(SamplingParams(seed=seed)).random() < 1


def test_normalization():
    p = SamplingParams(stop="###", top_k=0, stop_token_ids=(3, 4))
    assert p.stop == ["###"] and p.top_k == -1 and p.stop_token_ids == [3, 4]
    g = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.1)
    assert g.is_greedy and (g.top_p, g.top_k, g.min_p) == (1.0, -1, 0.0)
    assert SamplingParams(repetition_penalty=1.2).has_penalties
    assert not SamplingParams().has_penalties
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_lora_request():
    r = LoRARequest("sql", 1, "/a/sql")
    assert (r.lora_name, r.lora_int_id, r.lora_path) == ("sql", 1, "/a/sql")
    with pytest.raises(ValueError, match="lora_int_id must be >= 1"):
        LoRARequest("sql", 0, "/a")
    with pytest.raises(ValueError, match="lora_name must be a non-empty string"):
        LoRARequest("", 1, "/a")


def test_output_shapes():
    c = CompletionOutput(0, "hi", [5, 6], -1.5, [{5: Logprob(-0.5, 1)}, {6: Logprob(-1.0, 2)}])
    assert not c.finished()
    c.finish_reason = "length"
    out = RequestOutput("r1", "p", [1, 2], [None, {2: Logprob(-0.1, 1)}], [c], True)
    assert out.outputs[0].finished() and out.lora_request is None
