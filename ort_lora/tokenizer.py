"""Tokenizer layer: encode/decode, chat templates (rendered by chat_template.py) and
incremental detokenization.

Reads the files an exported model directory carries (the ones `transformers`'
`save_pretrained` writes): tokenizer.json (the Hugging Face `tokenizers` backend) and
tokenizer_config.json (special tokens, chat template; the template may also live in
chat_template.jinja or chat_template.json). Imports neither torch nor transformers.

Stop strings: `IncrementalDetokenizer` handles them (vLLM semantics): text that could be the
start of a stop string is held back, a matched stop string ends the output and is cut from it
unless `include_stop_str_in_output`. The engine only has to check `stopped`.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as _Backend

from ort_lora.chat_template import (
    CONFIG_FILE,
    ChatTemplateError,
    lone_surrogate,
    read_chat_template,
    render_chat_template,
)

TOKENIZER_FILE = "tokenizer.json"
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# vLLM starts incremental decoding this many prompt tokens back, for sentencepiece context.
PROMPT_CONTEXT_TOKENS = 5


def _check_unicode(text: str) -> None:
    """ValueError naming the first lone surrogate of `text`, if it has one."""
    where = lone_surrogate(text)
    if where is not None:
        raise ValueError(f"text to encode is not valid Unicode: {where}")


def _token_content(value) -> str | None:
    """A special token in tokenizer_config.json is a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """A model's tokenizer: the `tokenizers` backend plus its config (special tokens, chat
    template)."""

    def __init__(self, backend: _Backend, config: dict | None = None, chat_template=None):
        self.backend = backend
        self.config = dict(config or {})
        self.chat_template: str | None = chat_template
        self.special_tokens = {
            key: _token_content(self.config.get(key))
            for key in SPECIAL_TOKEN_KEYS
            if self.config.get(key) is not None
        }
        self.all_special_ids = sorted(
            tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load tokenizer.json + tokenizer_config.json (+ chat template) from `model_dir`."""
        model_dir = Path(model_dir)
        path = model_dir / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir}: no {TOKENIZER_FILE} (expected a tokenizer)")
        config = {}
        if (model_dir / CONFIG_FILE).is_file():
            config = json.loads((model_dir / CONFIG_FILE).read_text())
        return cls(_Backend.from_file(str(path)), config, read_chat_template(model_dir))

    # -- vocabulary ---------------------------------------------------------------------------

    @functools.cached_property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (a model's output layer may have
        more rows: padded embeddings; those ids decode as no text)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.special_tokens.get("bos_token"))

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.special_tokens.get("eos_token"))

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        return [self.backend.id_to_token(int(i)) for i in ids]

    # -- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. BOS).
        ValueError if `text` is not valid Unicode (a lone surrogate)."""
        return self._encode(text, add_special_tokens, release_gil=False)

    def encode_releasing_gil(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`encode`, with the GIL released while the backend works (its batch entry point
        releases it, the single-text one does not): a long text tokenized on a worker thread
        then does not stall the process's other threads (a server's event loop)."""
        return self._encode(text, add_special_tokens, release_gil=True)

    def _encode(self, text: str, add_special_tokens: bool, release_gil: bool) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        special = add_special_tokens
        try:
            if release_gil:
                return self.backend.encode_batch([text], add_special_tokens=special)[0].ids
            return self.backend.encode(text, add_special_tokens=special).ids
        except TypeError:  # the backend's answer to a lone surrogate: checked only then
            _check_unicode(text)
            raise

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one vocabulary entry's spelling has (added tokens included):
        no token covers more of an input text than this, for byte-level and sentencepiece
        vocabularies (server/limits.py: PromptBound says why)."""
        vocab = self.backend.get_vocab(with_added_tokens=True)
        return max((len(token.encode("utf-8")) for token in vocab), default=1)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids; raises ValueError naming an id outside the vocabulary."""
        ids = [int(i) for i in ids]
        vocab = self.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one generated token; "" for an id the tokenizer lacks (vLLM's way with
        the padding rows of an output layer larger than the vocabulary)."""
        if not 0 <= token_id < self.vocab_size:
            return ""
        return self.backend.decode([int(token_id)], skip_special_tokens=False)

    # -- chat ---------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        template: str | None = None,
        **kwargs,
    ) -> str:
        """Render `messages` ([{"role", "content"}, ...]) with `template` (default: the
        model's), as transformers' `apply_chat_template(..., tokenize=False)` does, sandboxed
        and bounded (chat_template.py); ChatTemplateError names what went wrong."""
        source = template or self.chat_template
        if not source:
            raise ChatTemplateError(
                "this model has no chat template (none in tokenizer_config.json or "
                "chat_template.jinja); use the completions API instead"
            )
        context = {**self.special_tokens, **kwargs}
        context.setdefault("tools", None)
        context.setdefault("documents", None)
        return render_chat_template(source, messages, add_generation_prompt, context)

    def detokenizer(self, prompt_ids: Sequence[int] = (), **kwargs) -> IncrementalDetokenizer:
        """A new per-request IncrementalDetokenizer (see its arguments)."""
        return IncrementalDetokenizer(self, prompt_ids, **kwargs)


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas, one request at a time.

    Decodes a short window (the previous tokens plus the new ones) and emits only the text
    beyond the window's previous decode, and only once it no longer ends in an incomplete
    UTF-8 sequence (U+FFFD): byte-level and sentencepiece pieces come out right (vLLM's
    prefix_offset / read_offset scheme). With `stop` strings, text that could begin a stop
    string is held back until it cannot; a match sets `stopped` and cuts the output there.
    Concatenating every `add` delta and the final `finish()` gives `text`.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        vocab = tokenizer.vocab_size  # ids it lacks (padded output rows) are no text
        context = [t for t in list(prompt_ids)[-PROMPT_CONTEXT_TOKENS:] if 0 <= t < vocab]
        self._ids: list[int] = context  # context tokens, then generated ones
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._decoded = ""  # stable text of the generated tokens
        self._emitted = 0  # chars of _decoded already returned
        self.stopped: str | None = None  # the stop string that ended the output

    @property
    def text(self) -> str:
        """The output text so far, as `add`/`finish` have returned it."""
        return self._decoded[: self._emitted]

    def add(self, token_ids: int | Iterable[int]) -> str:
        """Feed newly generated token id(s); return the new text that is safe to show."""
        if self.stopped is not None:
            return ""
        vocab = self.tokenizer.vocab_size
        new = [token_ids] if isinstance(token_ids, int) else token_ids
        self._ids.extend(t for t in new if 0 <= t < vocab)  # as in __init__
        self._decode_window(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """End of generation: return all text still held back (incomplete UTF-8 included)."""
        if self.stopped is not None:
            return ""
        self._decode_window(final=True)
        return self._release(final=True)

    def _decode_window(self, final: bool) -> None:
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip)
        full = decode(self._ids[self._prefix_offset :], skip)
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self._decoded += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)

    def _release(self, final: bool) -> str:
        end = len(self._decoded)
        if self.stop:
            end = self._match_stop(end, final)
        delta = self._decoded[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def _match_stop(self, end: int, final: bool) -> int:
        """Cut at the first complete stop string, else hold back a possible stop prefix."""
        # Text before _emitted holds no stop string and no stop begins there (it was held back).
        hits = [(self._decoded.find(s, self._emitted), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            index, stop = min(hits)
            self.stopped = stop
            cut = index + len(stop) if self.include_stop_str_in_output else index
            self._decoded = self._decoded[:cut]
            return cut
        if final:
            return end
        return end - self._stop_prefix_len()

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop."""
        tail = self._decoded[self._emitted :]
        best = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(tail)), best, -1):
                if tail.endswith(stop[:n]):
                    best = n
                    break
        return best
