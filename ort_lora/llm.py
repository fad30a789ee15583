"""LLM: the offline Python API, modelled on vLLM's.

from ort_lora import LLM, SamplingParams, LoRARequest
llm = LLM(model="out/smollm2", max_loras=4)
outs = llm.generate(["Hi", "Hello"], SamplingParams(max_tokens=16),
                    lora_request=[None, LoRARequest("upper", 1, "adapters/upper")])
replies = llm.chat([{"role": "user", "content": "Hi"}], lora_request=LoRARequest(...))
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from ort_lora.config import EngineConfig
from ort_lora.engine.llm_engine import LLMEngine
from ort_lora.lora_request import LoRARequest
from ort_lora.outputs import RequestOutput
from ort_lora.sampling_params import SamplingParams

PromptType = str | dict | list[int]


class LLM:
    """An exported model (see `ort-lora export`) served with any number of LoRA adapters.

    Keyword arguments are EngineConfig fields (max_num_seqs, max_num_batched_tokens, max_loras,
    max_cpu_loras, num_pages or pool_memory_bytes, max_model_len, ...), plus adapter_root,
    intra_op_num_threads, seed and device ("cpu", or "cuda" for a --device cuda export).
    """

    def __init__(
        self,
        model: str | Path,
        *,
        adapter_root: str | Path | None = None,
        intra_op_num_threads: int | None = None,
        seed: int | None = 0,
        device: str = "cpu",
        **config,
    ):
        self.engine = LLMEngine(
            model,
            EngineConfig(**config),
            adapter_root=adapter_root,
            intra_op_num_threads=intra_op_num_threads,
            seed=seed,
            device=device,
        )
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | list[LoRARequest] | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (str, token id list, or {"prompt_token_ids": [...]}).

        sampling_params and lora_request: one for all prompts or a list, one per prompt
        (None = the base model). A prompt's lora_request may itself be a list of
        LoRARequests: a composition, sum_i weight_i * adapter_i over its rows (each
        LoRARequest's `weight`, default 1.0; at most max_loras adapters, no DoRA adapter):
        lora_request=[[LoRARequest("a", 1, pa, weight=0.7), LoRARequest("b", 2, pb, 0.3)]]
        for one prompt. Returns RequestOutputs in the order of the prompts.
        """
        prompts = _as_list(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(prompts), "sampling_params")
        loras = _per_prompt(lora_request, len(prompts), "lora_request")
        ids = []
        for prompt, p, lora in zip(prompts, params, loras):
            rid = str(next(self._ids))
            self.engine.add_request(rid, _prompt_input(prompt), p, lora)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | list[LoRARequest] | None] | None = None,
        use_tqdm: bool = False,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation ([{"role": ..., "content": ...}, ...]) or a
        list of them, as vLLM's LLM.chat: each is rendered with `chat_template` (default: the
        model's; sandboxed, chat_template.py) and generated as `generate` does, with the same
        sampling_params and lora_request conventions."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = []
        for conversation in conversations:
            text = tok.apply_chat_template(
                list(conversation), add_generation_prompt, chat_template,
                **(chat_template_kwargs or {}),
            )  # fmt: skip
            prompts.append({"prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, lora_request, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        try:
            while len(done) < len(ids):
                outputs = self.engine.step()
                for rid, error in self.engine.take_failures():
                    if rid in ids:
                        raise error
                for out in outputs:
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in done:
                    self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in ids]


def _as_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
        return [prompts]
    return list(prompts)


def _prompt_input(prompt: PromptType):
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError("a dict prompt needs 'prompt_token_ids' or 'prompt'")
    return prompt


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name}: got {len(value)} values for {n} prompts")
        return list(value)
    return [value] * n


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="req")
