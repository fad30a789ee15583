"""OpenAI compatibility on the live SmolLM2 server (the session's `smollm2_server`): every
documented chat field through the openai SDK, chat logprobs that are the content's tokens
(no <|im_end|> entry), completions logprobs that keep it, cached_tokens in usage. The same
rules on a fake engine, case by case: tests/test_server_openai_fields.py."""

from __future__ import annotations

import openai
import pytest
from test_server_openai_fields import create_dropping_refused, documented, every_field

QUESTION = [{"role": "user", "content": "What is 2+2? Answer with one number."}]


@pytest.fixture(scope="module")
def live(smollm2_server):
    url, engine = smollm2_server
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), engine


def test_every_documented_field_live(live):
    client, engine = live
    table = documented()
    fields = {**every_field(), "model": engine.model_name, "stream": False}
    del fields["stream_options"]
    res, _ = create_dropping_refused(client, fields, table)
    assert len(res.choices) == 2 and res.usage.completion_tokens > 0
    assert all(c.logprobs.content for c in res.choices)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_chat_logprobs_join_to_the_content(live, skip_special_tokens):
    """Greedy, so the model ends its turn: the entries are the content's tokens, in the
    response and in the stream; <|im_end|> has an entry only when the content shows it."""
    client, engine = live
    kw = {"model": engine.model_name, "messages": QUESTION, "max_tokens": 40, "temperature": 0,
          "logprobs": True, "top_logprobs": 2,
          "extra_body": {"skip_special_tokens": skip_special_tokens}}  # fmt: skip
    res = client.chat.completions.create(**kw)
    choice = res.choices[0]
    assert choice.finish_reason == "stop"  # ended by <|im_end|>, not by max_tokens
    tokens = [e.token for e in choice.logprobs.content]
    assert "".join(tokens) == choice.message.content
    assert ("<|im_end|>" in tokens) == (not skip_special_tokens)
    assert res.usage.completion_tokens == len(tokens) + skip_special_tokens
    assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]  # fmt: skip
    assert streamed == tokens


def test_completion_logprobs_keep_the_stop_token(live):
    client, engine = live
    tok = engine.tokenizer
    prompt = tok.apply_chat_template([dict(m) for m in QUESTION], add_generation_prompt=True)
    res = client.completions.create(
        model=engine.model_name, prompt=prompt, max_tokens=40, temperature=0, logprobs=1
    )
    choice = res.choices[0]
    assert choice.finish_reason == "stop"
    tokens = choice.logprobs.tokens
    assert tokens[-1] == "<|im_end|>" and "".join(tokens[:-1]) == choice.text
    assert len(tokens) == res.usage.completion_tokens
    assert choice.logprobs.text_offset[-1] == len(choice.text)


def test_usage_has_cached_tokens(live):
    client, engine = live
    kw = {"model": engine.model_name, "messages": QUESTION, "max_tokens": 2}
    for _ in range(2):  # the second may find the first's prefix cached
        usage = client.chat.completions.create(**kw).usage
        assert 0 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens
    stream = client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    )
    usage = list(stream)[-1].usage
    assert 0 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens
