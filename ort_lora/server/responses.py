"""Response bodies of the OpenAI API, built from the engine's CompletionOutputs: completion and
chat choices, streamed chunks, logprobs in both of OpenAI's formats, usage. Pure functions."""

from __future__ import annotations

import json
from collections.abc import Callable

from ort_lora.outputs import CompletionOutput

DecodeToken = Callable[[int], str]


def sse(payload: dict | str) -> str:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens whose KV came from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def envelope(kind: str, request_id: str, created: int, model: str, choices: list) -> dict:
    return {
        "id": request_id,
        "object": kind,
        "created": created,
        "model": model,
        "choices": choices,
    }


def _lp(value) -> float:
    """A Logprob (or a bare float) as a float JSON can carry: below -9999.0 (vLLM's floor),
    -inf and NaN become -9999.0."""
    x = float(getattr(value, "logprob", value))
    return x if x >= -9999.0 else -9999.0  # a NaN fails the comparison too


def _top(position: dict, k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, logprob) of one position, best first."""
    ranked = sorted(position.items(), key=lambda kv: -_lp(kv[1]))
    return [(tid, _lp(v)) for tid, v in ranked[:k]]


def _token_text(position: dict, tid: int, decode: DecodeToken) -> str:
    value = position.get(tid)
    text = getattr(value, "decoded_token", None)
    return text if text is not None else decode(tid)


def completion_logprobs(
    token_ids: list[int], logprobs: list[dict | None], decode: DecodeToken, offset: int
) -> dict:
    """OpenAI's legacy completions format; `offset`: text length before these tokens. Each
    position's top_logprobs holds every entry it has: the top-k and the sampled (or actual)
    token, so logprobs=0 still shows the sampled token, as vLLM does. A None position (the
    first prompt token of an echo: nothing predicts it) has null logprob and top_logprobs."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for tid, position in zip(token_ids, logprobs, strict=False):
        if position is None:
            text = decode(tid)
            token_lps.append(None)
            tops.append(None)
        else:
            text = _token_text(position, tid, decode)
            token_lps.append(_lp(position[tid]) if tid in position else None)
            ranked = _top(position, len(position))
            tops.append({_token_text(position, t, decode): lp for t, lp in ranked})
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def prompt_logprobs(positions: list[dict | None] | None, decode: DecodeToken) -> list | None:
    """vLLM's prompt_logprobs field: per prompt position None (the first) or
    {"<token id>": {"logprob", "rank", "decoded_token"}}."""
    if positions is None:
        return None
    return [
        None
        if position is None
        else {
            str(tid): {
                "logprob": _lp(v),
                "rank": getattr(v, "rank", None),
                "decoded_token": _token_text(position, tid, decode),
            }
            for tid, v in position.items()
        }
        for position in positions
    ]


def _chat_entry(text: str, logprob: float | None) -> dict:
    lp = -9999.0 if logprob is None else _lp(logprob)
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_ids: list[int], logprobs: list[dict], k: int, decode: DecodeToken) -> dict:
    """OpenAI's chat format: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for tid, position in zip(token_ids, logprobs, strict=False):
        entry = _chat_entry(_token_text(position, tid, decode), _lp(position.get(tid, -9999.0)))
        entry["top_logprobs"] = [
            _chat_entry(_token_text(position, t, decode), lp) for t, lp in _top(position, k)
        ]
        content.append(entry)
    return {"content": content}


class ChoiceTracker:
    """What of one choice has been sent already, so streaming sends only the new part.

    text_prefix / ids_prefix / lps_prefix: what an echo puts in front of the output (the
    prompt's text, token ids and logprobs), sent with the first delta."""

    def __init__(self, index: int, text_prefix: str = ""):
        self.index = index
        self.sent_chars = 0
        self.sent_tokens = 0
        self.finished = False
        self.text_prefix = text_prefix
        self.ids_prefix: list[int] = []
        self.lps_prefix: list[dict | None] = []
        self.call_id: str | None = None  # a named tool call being streamed

    def delta(self, out: CompletionOutput) -> tuple[str, list[int], list[dict] | None]:
        """New text, token ids and logprobs since the last call."""
        text = out.text[self.sent_chars :]
        ids = list(out.token_ids[self.sent_tokens :])
        lps = None if out.logprobs is None else list(out.logprobs[self.sent_tokens :])
        if self.text_prefix:
            text, self.text_prefix = self.text_prefix + text, ""
        if self.ids_prefix:
            ids, lps = self.ids_prefix + ids, self.lps_prefix + (lps or [])
            self.ids_prefix, self.lps_prefix = [], []
        self.sent_chars, self.sent_tokens = len(out.text), len(out.token_ids)
        return text, ids, lps

    def is_news(self, out: CompletionOutput) -> bool:
        changed = len(out.text) > self.sent_chars or len(out.token_ids) > self.sent_tokens
        return changed or (out.finish_reason is not None and not self.finished)


# tokenizer_config.json entries that name files or how they were loaded, not the tokenizer
_LOADER_KEYS = frozenset(
    {"vocab_file", "merges_file", "tokenizer_file", "name_or_path", "is_local", "local_files_only"}
)


def tokenizer_info(tokenizer) -> dict:
    """vLLM's GET /tokenizer_info: the tokenizer's tokenizer_config.json entries (file paths
    left out; special tokens as their text, as an AddedToken's `content`), `tokenizer_class`
    and the chat template the server renders. lm-evaluation-harness reads `eos_token` (and
    `bos_token`) from it and tokenizes through /tokenize, with no tokenizer of its own."""
    info = {k: _token_content(v) for k, v in tokenizer.config.items() if k not in _LOADER_KEYS}
    decoder = info.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        info["added_tokens_decoder"] = {k: _token_content(v) for k, v in decoder.items()}
    info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    info.update(tokenizer.special_tokens)  # the special tokens' text, however they are given
    if tokenizer.chat_template:
        info["chat_template"] = tokenizer.chat_template
    return info


def _token_content(value):
    """An AddedToken dict ({"content": ..., "special": ...}) as its text; others as they are."""
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return value
