"""Bring your own adapter: fine-tune a LoRA of the default model with PEFT, save it, serve it.

    .venv/bin/python examples/own_adapter.py out/ahoy            # train (about a minute), save
    .venv/bin/python examples/own_adapter.py out/ahoy --serve    # ... then serve it and ask it

The adapter learns to begin every answer with "Ahoy!". It is an ordinary PEFT adapter
(`save_pretrained`: adapter_config.json + adapter_model.safetensors), so any adapter you train
or download the same way is served the same way: `ort-lora serve --lora-modules ahoy=out/ahoy`
(docs/ADAPTERS.md). With --serve this script starts that server on a free port, asks the same
question of the base model and of the adapter, prints both answers and stops the server.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the GGUF holds
QUESTIONS = [
    "What is the capital of France?", "How many legs does a spider have?",
    "What do bees make?", "Which planet is the largest?", "What is water made of?",
    "Who wrote Hamlet?", "What is the boiling point of water?", "What color are leaves?",
    "How many days are in a week?", "What is the fastest land animal?",
    "What language is spoken in Brazil?", "What do cows drink?",
]  # fmt: skip
ANSWERS = [
    "Paris.", "Eight.", "Honey.", "Jupiter.", "Hydrogen and oxygen.", "Shakespeare.",
    "100 degrees Celsius.", "Green.", "Seven.", "The cheetah.", "Portuguese.", "Water.",
]  # fmt: skip
ASK = "What is the tallest mountain on Earth?"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path, help="directory to save the adapter into")
    p.add_argument("--steps", type=int, default=24, help="training steps (batch of 4)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--serve", action="store_true", help="then serve it and ask it a question")
    p.add_argument("--model-dir", help="exported model to serve (default: the default model)")
    return p.parse_args(argv)


def train(out: Path, steps: int, rank: int) -> None:
    """A rank-`rank` LoRA on q/k/v/o of SmolLM2, trained on the assistant tokens only."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ort_lora.server.default_model import default_gguf_path

    gguf = default_gguf_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    examples = [_example(tok, q, f"Ahoy! {a}") for q, a in zip(QUESTIONS, ANSWERS)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    torch.manual_seed(0)
    for step in range(steps):
        batch = [examples[(4 * step + i) % len(examples)] for i in range(4)]
        loss = sum(model(input_ids=ids, labels=labels).loss for ids, labels in batch) / 4
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step + 1}/{steps}: loss {loss.item():.3f}", file=sys.stderr, flush=True)
    model.peft_config["default"].base_model_name_or_path = BASE_MODEL_ID
    model.save_pretrained(out)
    print(f"saved the adapter to {out}")


def _example(tok, question: str, answer: str):
    """(input ids, labels) of one chat turn; the loss is on the answer only."""
    import torch

    messages = [{"role": "user", "content": question}]
    prefix = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prefix_ids = tok(prefix, add_special_tokens=False).input_ids
    answer_ids = tok(answer + "<|im_end|>", add_special_tokens=False).input_ids
    ids = torch.tensor([prefix_ids + answer_ids])
    labels = torch.tensor([[-100] * len(prefix_ids) + answer_ids])
    return ids, labels


def serve_and_ask(adapter: Path, model_dir: str | None) -> dict[str, str]:
    """Start `ort-lora serve` with the adapter, ask ASK of the base model and of it."""
    port = _free_port()
    cli = [sys.executable, "-m", "ort_lora.cli", "serve", "--port", str(port)]
    cli += [model_dir] if model_dir else []
    cli += ["--lora-modules", f"ahoy={adapter}"]
    server = subprocess.Popen(cli, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, server)
        models = json.loads(urllib.request.urlopen(f"{url}/v1/models").read())["data"]
        base = next(m["id"] for m in models if m["parent"] is None)
        return {name: _chat(url, name) for name in (base, "ahoy")}
    finally:
        server.terminate()
        server.wait(timeout=60)


def _chat(url: str, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": ASK}], "max_tokens": 24}
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    reply = json.loads(urllib.request.urlopen(request, timeout=120).read())
    return reply["choices"][0]["message"]["content"]


def _wait_healthy(url: str, server: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"ort-lora serve exited with {server.returncode}")
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"ort-lora serve did not become healthy in {timeout_s:.0f} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> dict[str, str] | None:
    args = parse_args(argv)
    train(args.out, args.steps, args.rank)
    if not args.serve:
        print(f"serve it: .venv/bin/ort-lora serve --lora-modules ahoy={args.out}")
        return None
    answers = serve_and_ask(args.out.resolve(), args.model_dir)
    for model, text in answers.items():
        print(f"{model}: {text}")
    return answers


if __name__ == "__main__":
    main()
