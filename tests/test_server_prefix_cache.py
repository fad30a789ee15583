"""Prefix caching through the OpenAI API on the default model: a repeated chat reports its
cached prompt tokens as OpenAI does (usage.prompt_tokens_details.cached_tokens, streamed
too) and answers the same, logprobs to the bit; the same messages under an adapter find
nothing cached; /metrics counts the lookups."""

from __future__ import annotations

import time
import uuid

import httpx
import openai


def _messages() -> list[dict]:
    """A system prompt of several KV blocks that no other test sends (a fresh nonce)."""
    rules = " ".join(f"Rule {i}: answer briefly and politely." for i in range(12))
    return [
        {"role": "system", "content": f"Session {uuid.uuid4().hex}. {rules}"},
        {"role": "user", "content": "Name a colour."},
    ]


def _cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def _scores(completion) -> list:
    """Each output token's logprob and its top 3 alternatives' logprobs."""
    content = completion.choices[0].logprobs.content
    return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in content]


def test_a_repeated_chat_reports_cached_tokens_and_answers_the_same(smollm2_server):
    url, engine = smollm2_server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    messages, args = _messages(), {"max_tokens": 8, "temperature": 0.0}
    scored = {**args, "logprobs": True, "top_logprobs": 3}
    first = client.chat.completions.create(model=engine.model_name, messages=messages, **scored)
    again = client.chat.completions.create(model=engine.model_name, messages=messages, **scored)
    other = client.chat.completions.create(model="upper", messages=messages, **args)
    assert _cached(first.usage) == 0
    assert 0 < _cached(again.usage) < again.usage.prompt_tokens
    # the same answer, and the same logprobs to the bit (the int4 model's int8 activations
    # would turn any difference in the cached prefix's arithmetic into a visible one)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert _scores(again) == _scores(first)
    assert _cached(other.usage) == 0  # another adapter's KV differs: nothing shared
    options = {"stream": True, "stream_options": {"include_usage": True}}
    stream = client.chat.completions.create(model="upper", messages=messages, **options, **args)
    usage = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    assert _cached(usage) == _cached(again.usage)  # the blocks the first upper request left
    # /metrics shows the engine's stats snapshot, refreshed every 0.25 s: wait for it
    deadline, hits = time.monotonic() + 5.0, 0.0
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{url}/metrics").text
        lines = [ln for ln in metrics.splitlines() if ln.startswith("ort_lora:prefix_cache_hits")]
        hits = float(lines[0].split()[-1]) if lines else 0.0
        if hits >= _cached(again.usage) + _cached(usage):
            break
        time.sleep(0.05)
    assert hits >= _cached(again.usage) + _cached(usage)
    assert 'ort_lora:lora_prefix_hits_total{lora_name="upper"}' in metrics
