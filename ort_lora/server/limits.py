"""Bounds on what one request may ask of the server, checked before any work is done on it.

    limit                        default   where / flag               a client over it gets
    request body                 2 MiB     --max-request-bytes        413 (as the body streams)
    prompt / chat text           derived   max_model_len (PromptBound) 400 naming the field
    prompts per request          1024      --max-queued-requests      400 naming `prompt`
    token ids of one prompt      max_model_len                         400 naming `prompt`
    chat messages                4096      MAX_MESSAGES               400 naming `messages`
    stop strings                 16        MAX_STOP                   400 naming `stop`
    stop_token_ids               1024      MAX_STOP_TOKEN_IDS         400 naming the field
    logit_bias entries           1024      MAX_LOGIT_BIAS             400 naming the field
    tools                        128       MAX_TOOLS                  400 naming `tools`
    constraint source            64 KiB    MAX_CONSTRAINT_CHARS       400 naming the field
      (a JSON schema as JSON text, a regex, a grammar, or choices: the grammar compiler's input)

The body limit is an ASGI middleware (`BodyLimit`): a declared Content-Length over it is
refused before a byte is read, a streamed (chunked) body as soon as its count passes it, so
no more than the limit is ever held. The list limits are the protocol models' `max_length`
(protocol.py), checked on the parsed JSON before the models validate it (bodies.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ort_lora.server.errors import APIError

MIB = 1 << 20
# Parsing a body holds the GIL (json.loads allocates an object per value): a body of the most
# values 2 MiB holds keeps every other route waiting ~40 ms here, 4 MiB twice that; /health
# p99 under a sustained hostile mix 78 ms at 2 MiB, 129 ms at 4 MiB (docs/RELIABILITY.md).
# Ample for a prompt: SmolLM2's 8,192-token context is ~40 KB of text, a 128k one ~600 KB.
DEFAULT_MAX_REQUEST_BYTES = 2 * MIB
MAX_MESSAGES = 4096
MAX_STOP = 16
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # OpenAI takes 300; vLLM does not bound it
MAX_TOOLS = 128
MAX_CONSTRAINT_CHARS = 64 * 1024
# How much longer than the strict bound a prompt may be (see PromptBound)
PROMPT_MARGIN = 4


class RequestTooLarge(APIError):
    """413: the body passed --max-request-bytes."""

    def __init__(self, limit: int):
        super().__init__(
            413,
            f"the request body is larger than {limit} bytes ({limit / MIB:.1f} MiB), this "
            "server's limit (--max-request-bytes)",
            code="request_too_large",
        )


class BodyLimit:
    """ASGI middleware: HTTP request bodies of at most `max_bytes` bytes, else 413 with
    OpenAI's error body. Routes that read the body past the limit raise RequestTooLarge
    (the app's APIError handler answers it); one that escapes is answered here."""

    def __init__(self, app, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_request_bytes must be a positive byte count, got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            # uvicorn reads and drops the unread body: the client still gets this answer
            return await RequestTooLarge(self.max_bytes).response()(scope, receive, send)
        seen, started = 0, False

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise RequestTooLarge(self.max_bytes)
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        except RequestTooLarge as exc:
            if started:
                raise
            await exc.response()(scope, receive, send)


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server's HTTP parser refuses it
    return None


@dataclass(frozen=True)
class PromptBound:
    """The longest prompt text (in characters) worth tokenizing: longer ones are refused
    with a 400 before the tokenizer sees them.

    Why it is safe: a text of more than `max_model_len * max_token_bytes` bytes tokenizes to
    more than `max_model_len` tokens, a prompt the engine refuses anyway, when every byte of
    the text is covered by a token whose vocabulary spelling is at least as long as what it
    covers. That holds for byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen: one vocabulary
    character per input byte), for sentencepiece with byte fallback (Llama 2, Mistral: the
    "▁" spelling of a space is 3 bytes, a fallback token "<0x41>" 6) and for WordPiece
    ("##" prefixes), and for added tokens (spelled as they appear). Characters are counted,
    not bytes: a text has at least as many bytes as characters, so a text over the bound in
    characters is over it in bytes.

    It is not strict where the tokenizer drops or merges input: an NFC/NFKC normalizer may
    compose up to 3 code points into one (Hangul jamo), a whitespace pre-tokenizer (BERT)
    drops spaces, an unknown-token model may fuse a run of unknown characters into one token.
    Hence PROMPT_MARGIN: the bound is 4x the strict one, which covers composition; for the
    whitespace-dropping and unknown-fusing tokenizers (not those of causal LMs) it is a cap on
    work rather than a consequence of the context length.
    """

    max_model_len: int
    max_token_bytes: int

    def __post_init__(self):
        if self.max_model_len < 1 or self.max_token_bytes < 1:
            raise ValueError(f"PromptBound needs positive sizes, got {self}")

    @classmethod
    def for_engine(cls, engine) -> PromptBound:
        """The bound of `engine`'s context length and tokenizer (its longest token). Every
        engine has a tokenizer: the local one, and the Ray ingress (ray/client.py) its own."""
        return cls(engine.max_model_len, engine.tokenizer.max_token_bytes)

    @property
    def max_chars(self) -> int:
        return self.max_model_len * self.max_token_bytes * PROMPT_MARGIN

    def check_text(self, chars: int, param: str) -> None:
        """400 naming `param` if a text of `chars` characters is over the bound."""
        if chars > self.max_chars:
            raise APIError(
                400,
                f"{param}: {chars} characters, more than the {self.max_model_len}-token context "
                f"can hold (at most {self.max_chars} characters: max_model_len x "
                f"{self.max_token_bytes} bytes per token at most x {PROMPT_MARGIN})",
                param=param,
                code="prompt_too_long",
            )

    def check_ids(self, count: int, param: str) -> None:
        """400 naming `param` for a token-id prompt longer than the context."""
        if count > self.max_model_len:
            raise APIError(
                400,
                f"{param}: {count} token ids; this model's maximum context length is "
                f"{self.max_model_len} tokens",
                param=param,
                code="prompt_too_long",
            )
