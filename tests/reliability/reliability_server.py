"""The reliability suite's server and its checks (fixtures in conftest.py).

The real engine on the tiny random Llama (the top conftest's export), two PEFT adapters under
an adapter root, runtime loading on, max_model_len 64 so that no fuzzed request runs long.
After every hostile group the suite checks that the server is healthy and that a fixed
greedy request still returns the text it returned at the start.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from ort_lora.bench.harness.servers import ServerThread
from ort_lora.lora_request import LoRARequest
from ort_lora.server import create_app

MAX_MODEL_LEN = 64
GREEDY = {"prompt": [5, 17, 99, 3, 42], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
TIMEOUT_S = 60.0  # every request must be answered within this (a hang fails the test)
# `make fuzz` sets ORT_LORA_FUZZ_SCALE (e.g. 10) to run every fuzzer that many times longer
SCALE = float(os.environ.get("ORT_LORA_FUZZ_SCALE", "1"))


@dataclass
class Served:
    url: str
    engine: object  # AsyncEngine
    root: Path
    base: str
    reference: str = ""  # the fixed greedy request's text at start

    def post(self, path: str, body=None, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=TIMEOUT_S, **kwargs)

    def greedy_text(self) -> str:
        r = self.post("/v1/completions", {"model": self.base, **GREEDY})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def assert_serving(self) -> None:
        """Healthy, and the fixed greedy request's output unchanged."""
        health = httpx.get(self.url + "/health", timeout=TIMEOUT_S)
        assert health.status_code == 200, health.text
        assert self.greedy_text() == self.reference


def write_adapter(base_checkpoint: Path, out: Path, seed: int, **lora_kwargs) -> Path:
    """A random PEFT adapter of the tiny model (LoRA weights of unit scale: it matters)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_checkpoint, dtype=torch.float32)
    kwargs = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]} | lora_kwargs
    peft_model = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(**kwargs))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.5)
    peft_model.save_pretrained(out)
    return out


@contextmanager
def serve(model_dir: Path, root: Path, **engine_kwargs) -> Iterator[Served]:
    """A started server over a fresh engine, adapters "qv" and "mlp" of `root` registered."""
    from ort_lora.engine.async_engine import AsyncEngine

    kwargs = dict(num_pages=128, max_model_len=MAX_MODEL_LEN, max_loras=4, max_cpu_loras=16)
    kwargs |= engine_kwargs
    engine = AsyncEngine.from_model_dir(model_dir, **kwargs)
    engine.add_lora(LoRARequest("qv", 1, str(root / "qv")))
    engine.add_lora(LoRARequest("mlp", 2, str(root / "mlp")))
    with ServerThread(create_app(engine, adapter_root=root)) as url:
        served = Served(url, engine, root, engine.model_name)
        served.reference = served.greedy_text()
        yield served
