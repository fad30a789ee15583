"""--verify: compare an export with transformers on the same checkpoint.

A quantized export is compared with transformers on its own dequantized weights (the numbers
the graph holds, quant_reference.py). What --verify checks runs the export's MatMulNBits and
QuantMatMul at accuracy_level 0 (float inputs; a copy of the graph, the weights shared), so
the float tolerance holds and a wrong block, scale or offset shows. The served accuracy_level
4 rounds every input to int8 per block on top: a real difference, reported beside the check
(SmolLM2: up to ~1.5 on logits of ~23). Emulating that rounding in the reference does not
help a deep model: the first input that rounds differently (float32 summation order) changes
every later layer's inputs; the tiny-model tests, where it does help, use it (quant_cases.py).

For each prompt: prefill (logits of the last prompt token), then greedy decode steps through the
paged cache (one token per step, the pages of the sequence spread over several blocks), each
compared with transformers running with its own KV cache. Returns the max |logit difference|.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from ort_lora.export.errors import ExportError

PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "1, 2, 3, 4,")


def load_reference(model_path):
    """The transformers model (float32, eval) of a checkpoint dir or .gguf file."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    kwargs = {"dtype": torch.float32}
    if path.is_file():
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, **kwargs
        ).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), **kwargs).eval()


def _prompt_ids(out_dir: Path, vocab: int, count: int) -> list[list[int]]:
    if (out_dir / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(out_dir))
        return [tok(p)["input_ids"] for p in PROMPTS[:count]]
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, size=n).tolist() for n in (7, 13, 20)[:count]]


def reference_step(model, token_ids: list[int], cache=None):
    """(logits [len(token_ids), vocab] numpy, cache) of transformers with its own KV cache;
    the cache keyword is `cache` in recent transformers, `past_key_values` before."""
    import inspect

    import torch

    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(torch.tensor([token_ids]), use_cache=True, **{key: cache})
    return out.logits[0].numpy(), getattr(out, key)


def compare_greedy(reference, runner, prompt: list[int], steps: int) -> float:
    """Max |logits diff| over the prefill and `steps` greedy decode steps of one prompt."""
    from ort_lora.engine.step_plan import base_plan

    bs = runner.block_size
    blocks = list(range(-(-(len(prompt) + steps) // bs)))
    logits, cache = reference_step(reference, prompt)
    ref = logits[-1]  # [vocab]
    ours = runner.run(base_plan((prompt, 0, blocks), block_size=bs))[0]
    worst = float(np.abs(ours - ref).max())
    for past in range(len(prompt), len(prompt) + steps):
        token = int(ref.argmax())
        logits, cache = reference_step(reference, [token], cache)
        ref = logits[-1]
        ours = runner.run(base_plan(([token], past, blocks), block_size=bs))[0]
        worst = max(worst, float(np.abs(ours - ref).max()))
    return worst


def verify_export(
    model_path,
    out_dir,
    *,
    num_prompts: int = 3,
    steps: int = 8,
    accuracy_level=None,
    progress: bool = False,
) -> float:
    """Max |logits diff| between the export in out_dir and transformers on model_path
    (a quantized export: on its dequantized weights). accuracy_level: run a quantized
    export's MatMulNBits at this level instead of the recorded one (0: float inputs).
    progress: say on stderr what it is doing (loading the reference takes a while)."""
    from ort_lora.contract import ModelManifest
    from ort_lora.engine.model_runner import ModelRunner
    from ort_lora.export.quant_reference import use_exported_weights
    from ort_lora.runtime.session import ModelSession

    out_dir = Path(out_dir)
    manifest = ModelManifest.load(out_dir)
    if manifest.device != "cpu":
        raise ExportError(f"--verify runs on CPU; this export is for device {manifest.device}")
    prompts = _prompt_ids(out_dir, manifest.vocab_size, num_prompts)
    pages = max(-(-(len(p) + steps) // manifest.block_size) for p in prompts)
    say = _progress_printer(progress)
    say(f"loading {Path(model_path).name} in transformers (the reference)")
    reference = load_reference(model_path)
    use_long_rope_factors(reference, manifest.max_position_embeddings)
    use_exported_weights(reference, out_dir, manifest, emulate=False)  # quantized: its numbers
    with at_accuracy_level(out_dir, accuracy_level) as model_dir:
        runner = ModelRunner(ModelSession(model_dir, num_pages=pages))
        worst = 0.0
        for i, p in enumerate(prompts):
            say(f"prompt {i + 1}/{len(prompts)}: prefill + {steps} paged decode steps")
            worst = max(worst, compare_greedy(reference, runner, p, steps))
        return worst


def _progress_printer(on: bool):
    def say(message: str) -> None:
        if on:
            print(f"verify: {message}", file=sys.stderr, flush=True)

    return say


@contextlib.contextmanager
def at_accuracy_level(out_dir: Path, level: int | None):
    """out_dir itself, or (level given, a quantized export recorded at another level) a
    temporary model directory whose graph runs MatMulNBits / QuantMatMul at `level`, data
    shared."""
    from ort_lora import contract as C

    manifest = json.loads((out_dir / C.MANIFEST_NAME).read_text())
    quant = manifest.get("quantization") or {}
    if level is None or not quant or quant["accuracy_level"] == level:
        yield out_dir
        return
    import onnx

    model = onnx.load(str(out_dir / C.MODEL_NAME), load_external_data=False)
    for node in model.graph.node:
        if node.op_type in ("MatMulNBits", "QuantMatMul"):
            kept = [a for a in node.attribute if a.name != "accuracy_level"]
            del node.attribute[:]
            node.attribute.extend([*kept, onnx.helper.make_attribute("accuracy_level", level)])
    # a sibling of out_dir: ORT refuses external data outside the model's directory (a
    # symlink included), and a hard link needs the same file system
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}.verify_", dir=out_dir.parent) as tmp:
        tmp = Path(tmp)
        (tmp / C.MODEL_NAME).write_bytes(model.SerializeToString())
        data = f"{C.MODEL_NAME}.data"
        try:
            os.link(out_dir / data, tmp / data)
        except OSError:
            shutil.copyfile(out_dir / data, tmp / data)
        manifest["quantization"] = {**quant, "accuracy_level": level}
        (tmp / C.MANIFEST_NAME).write_text(json.dumps(manifest))
        yield tmp


def use_long_rope_factors(model, context: int) -> None:
    """An export serving more than LongRoPE's original context rotates every position with the
    long factors (rope.py), as transformers does for sequences longer than the original only:
    give the reference the long factors for shorter ones too (its own long-context path)."""
    params = getattr(model.config, "rope_parameters", None) or {}
    if params.get("rope_type") != "longrope":
        return
    if context <= params["original_max_position_embeddings"]:
        return
    params["short_factor"] = list(params["long_factor"])
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=model.config)
