"""How close an int4 export of a float checkpoint stays to it: round-to-nearest against
HQQ-style refinement (`ort-lora export --weights int4 --extra quant_method=rtn|hqq`).

    python bench/bench_quant_methods.py --checkpoint .cache/bench/smollm2/hf \\
        --out docs/bench/quant_methods.json

Both exports quantize every linear weight of the checkpoint (a float one: nothing is carried
over from a GGUF) with the same scales, block 32; they differ in the zero points (hqq: a float
per block, stored as an integer one plus an offset). For the demo tasks' held-out prompts
(chat template) every prompt position's next-token logits are compared with transformers on
the float checkpoint: mean KL(float || int4), how often the top token is the same, and the
largest logit difference, as served (int8 inputs, accuracy_level 4) and on the weights alone
(float inputs, accuracy_level 0, --verify's copy of the graph). Prints a table, writes JSON
and a plot next to it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

METHODS = ("rtn", "hqq")


def reference_logits(checkpoint: Path, prompts: list[list[int]]) -> list[np.ndarray]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].numpy() for ids in prompts]


def export_logits(export_dir: Path, prompts: list[list[int]], level: int) -> list[np.ndarray]:
    from ort_lora.engine.model_runner import ModelRunner
    from ort_lora.engine.step_plan import base_plan
    from ort_lora.export.verify import at_accuracy_level
    from ort_lora.runtime import ModelSession

    with at_accuracy_level(export_dir, level) as model_dir:
        runner = ModelRunner(ModelSession(model_dir, num_pages=16))
        bs, out = runner.block_size, []
        for ids in prompts:
            pages = list(range(-(-len(ids) // bs)))
            out.append(runner.run(base_plan((ids, 0, pages, range(len(ids))), block_size=bs)))
        return out


def compare(ours: list[np.ndarray], theirs: list[np.ndarray]) -> dict:
    kl, same, diff = [], [], 0.0
    for a, b in zip(ours, theirs, strict=True):
        a, b = a.astype(np.float64), b.astype(np.float64)
        la = a - np.logaddexp.reduce(a, axis=-1, keepdims=True)
        lb = b - np.logaddexp.reduce(b, axis=-1, keepdims=True)
        kl.extend((np.exp(lb) * (lb - la)).sum(-1))
        same.extend(a.argmax(-1) == b.argmax(-1))
        diff = max(diff, float(np.abs(a - b).max()))
    return {"mean_kl": float(np.mean(kl)), "top1_same": float(np.mean(same)), "max_diff": diff}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    panels = [(axes[0], "mean_kl", "mean KL(float || int4)")]
    panels.append((axes[1], "top1_same", "top token as float's"))
    for ax, key, title in panels:
        for i, level in enumerate(("served", "weights")):
            values = [results[m][level][key] for m in METHODS]
            ax.bar(np.arange(len(METHODS)) + 0.4 * i, values, 0.4, label=level)
        ax.set_xticks(np.arange(len(METHODS)) + 0.2, METHODS)
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=".cache/bench/smollm2/hf", help="a float HF checkpoint")
    p.add_argument("--cache-dir", default=".cache/bench/quant_methods")
    p.add_argument("--prompts", type=int, default=24, help="held-out prompts, spread over tasks")
    p.add_argument("--out", default="results/quant_methods.json")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from ort_lora.demo.tasks import TASKS
    from ort_lora.export import export_model

    checkpoint, cache = Path(args.checkpoint), Path(args.cache_dir)
    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    per_task = -(-args.prompts // len(TASKS))
    texts = [t for task in TASKS.values() for t in task.split_prompts("eval")[:per_task]]
    prompts = []
    for text in texts[: args.prompts]:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    print(f"{len(prompts)} prompts, {sum(map(len, prompts))} positions", flush=True)
    theirs = reference_logits(checkpoint, prompts)
    results = {}
    for method in METHODS:
        out = cache / f"int4_{method}"
        if not (out / "ort_lora_manifest.json").exists():
            t0 = time.perf_counter()
            extra = {"quant_method": method}
            export_model(checkpoint, out, weights="int4", force=True, progress=True, extra=extra)
            print(f"exported {method} in {time.perf_counter() - t0:.0f} s", flush=True)
        results[method] = {
            "served": compare(export_logits(out, prompts, 4), theirs),
            "weights": compare(export_logits(out, prompts, 0), theirs),
        }
    print(f"\n{'method':8s} {'inputs':8s} {'mean KL':>10s} {'top-1 same':>11s} {'max |diff|':>11s}")
    for method, levels in results.items():
        for level, r in levels.items():
            print(
                f"{method:8s} {level:8s} {r['mean_kl']:10.4f} {r['top1_same']:11.3f} "
                f"{r['max_diff']:11.2f}"
            )
    doc = {
        "command": "python bench/bench_quant_methods.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "checkpoint": str(checkpoint),
        "prompts": len(prompts),
        "positions": sum(map(len, prompts)),
        "results": results,
    }
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    plot(results, out_path.with_suffix(".png"))
    print(f"wrote {out_path} and {out_path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
