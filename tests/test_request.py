"""Requests at the engine's entry and as they finish: check_request (the one validation) and
the stop rules of Completion.add_token, with no model (a word-level tokenizer made here)."""

from __future__ import annotations

import pytest

from ort_lora.engine.request import NOT_STOPPED, RequestLimits, RequestState, check_request
from ort_lora.engine.sequence import Sequence
from ort_lora.errors import RequestError
from ort_lora.sampling_params import SamplingParams
from ort_lora.tokenizer import Tokenizer

LIMITS = RequestLimits(vocab_size=100, max_model_len=40, block_size=4, num_pages=12)
WORDS = ["</s>", "<unk>", "hello", "world", "END", "x", "y"]
EOS = WORDS.index("</s>")


@pytest.mark.parametrize(
    "prompt, max_tokens, pages, param, message",
    [
        ([], 4, 0, "prompt", "the prompt is empty"),
        ([3, 100, -1], 4, 0, "prompt", r"ids \[100, -1\] are outside the vocabulary \[0, 100\)"),
        ([1] * 40, None, 0, "prompt", r"length is 40 tokens.*the prompt has 40 tokens"),
        ([1] * 41, 5, 0, "prompt", r"the prompt has 41 tokens, which leaves no room"),
        ([1] * 30, 11, 0, "max_tokens", r"you requested 41 tokens \(30 in the prompt, 11 in"),
        ([1] * 20, 12, 5, "max_tokens", r"32 tokens need 8 KV pages \+ 5 adapter pages, more"),
        ([1] * 36, 1, 5, "prompt", r"37 tokens need 10 KV pages.*; shorten the prompt"),
    ],
)
def test_check_request_names_the_problem(prompt, max_tokens, pages, param, message):
    with pytest.raises(RequestError, match=message) as info:
        check_request(prompt, SamplingParams(max_tokens=max_tokens), pages, LIMITS)
    assert info.value.param == param


def test_check_request_resolves_max_tokens():
    assert check_request([1] * 10, SamplingParams(max_tokens=None), 0, LIMITS) == 30
    assert check_request([1] * 10, SamplingParams(max_tokens=5), 3, LIMITS) == 5
    assert check_request([1] * 22, SamplingParams(max_tokens=2), 6, LIMITS) == 2  # 6 + 6 pages


def _completion(**params):
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    backend = Backend(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["</s>"])
    sp = SamplingParams(max_tokens=8, **params)
    seq = Sequence("r#0", [2], 8, sampling_params=sp)
    state = RequestState.create("r", None, [2], sp, None, [seq], Tokenizer(backend))
    return state.completions[0]


def _feed(completion, words) -> list:
    return [completion.add_token(WORDS.index(w), [EOS]) for w in words]


def test_stop_rules():
    """A stop string (cut from the text), EOS unless ignored, a stop token id; never length
    (the scheduler's)."""
    c = _completion(stop=["END"])
    assert _feed(c, ["world", "x", "END", "y"])[:3] == [NOT_STOPPED, NOT_STOPPED, "END"]
    assert c.detok.text.split() == ["world", "x"]  # cut before the stop string
    assert _feed(_completion(), ["world", "</s>"]) == [NOT_STOPPED, None]
    assert _feed(_completion(ignore_eos=True), ["</s>"]) == [NOT_STOPPED]
    assert _feed(_completion(stop_token_ids=[5]), ["world", "x"]) == [NOT_STOPPED, 5]
    both = _completion(stop=["x"], stop_token_ids=[5])  # the string is checked first
    assert _feed(both, ["x"]) == ["x"]
    assert set(_feed(_completion(), ["world"] * 12)) == {NOT_STOPPED}
