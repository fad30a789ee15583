"""Which export should `ort-lora serve` run by default: float32 or int4, and with which adapter
rows?

    python bench/bench_default_model.py --out docs/bench/default_model.json
    python bench/bench_default_model.py --variants int4,int4-int8rows --out ...

Every variant is an export of the same SmolLM2-135M-Instruct GGUF (int4 carries its Q4_1 blocks
over; ort_lora/server/default_model.py; "-int8rows": adapter rows int8 with a scale per row,
export --adapter-dtype int8; "int4zp": Q4_1's minimum rounded to an integer zero point, --extra
gguf_q4_1=zero_point), served with the three demo adapters. Measured in one process,
the exports alternating, their engines on one thread pool (bench_ops.share_one_pool):

- quality: held-out success of every demo task (ort_lora/demo/tasks.py, the whole "eval"
  split, greedy, 24 new tokens, the chat template), with its adapter and on the base model,
  and how many answers each export shares word for word with the first variant;
- speed: the demo adapters' held-out prompts served at two loads, one request at a time
  (interactive) and all at once (a busy server), 32 new tokens each (EOS ignored): output
  tokens per wall second and per CPU second of this process, median of --reps alternating
  rounds.

Prints a table and writes the numbers (with the command, date, machine and load) as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

VARIANTS = {
    "float32": {},
    "int4": {"weights": "int4"},
    "int4-int8rows": {"weights": "int4", "adapter_dtype": "int8"},
    # Q4_1's float minimum rounded to MatMulNBits' integer zero point (no offset branch)
    "int4zp-int8rows": {
        "weights": "int4",
        "adapter_dtype": "int8",
        "extra": {"gguf_q4_1": "zero_point"},
    },
}
NEW_TOKENS_QUALITY = 24
NEW_TOKENS_SPEED = 32


def exports(cache: Path, names: list[str]) -> dict[str, Path]:
    """The named exports of the default model, built once into `cache`."""
    from ort_lora.export import export_model
    from ort_lora.server.default_model import default_gguf_path

    out = {}
    for name in names:
        options = VARIANTS[name]
        path = cache / f"default_{name}"
        if not (path / "ort_lora_manifest.json").is_file():
            export_model(default_gguf_path(), path, force=True, progress=False, **options)
        out[name] = path
    return out


def chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return tokenizer.encode(text, add_special_tokens=False)


def quality(llm, tasks) -> dict:
    """Per task: held-out success with its adapter and on the base model, and the answers."""
    from ort_lora import LoRARequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS_QUALITY)
    tok, out = llm.get_tokenizer(), {}
    for i, (name, task) in enumerate(tasks.items()):
        prompts = task.split_prompts("eval")
        ids = [{"prompt_token_ids": chat_ids(tok, p)} for p in prompts]
        lora = LoRARequest(name, i + 1, str(task.adapter_dir))
        answers = {}
        for which, req in (("adapter", lora), ("base", None)):
            done = llm.generate(ids, params, lora_request=req)
            answers[which] = [o.outputs[0].text for o in done]
        out[name] = {
            "prompts": len(prompts),
            **{
                f"{w}_success": sum(map(task.check, prompts, a)) / len(prompts)
                for w, a in answers.items()
            },
            "answers": answers,
        }
    return out


def speed(llm, tasks, concurrent: bool) -> dict:
    """Output tokens per second (wall and CPU) serving every task's held-out prompts with
    its adapter: one request at a time, or all submitted together."""
    from ort_lora import LoRARequest, SamplingParams

    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS_SPEED, ignore_eos=True)
    jobs = []
    for i, (name, task) in enumerate(tasks.items()):
        lora = LoRARequest(name, i + 1, str(task.adapter_dir))
        prompts = task.split_prompts("eval")[: 8 if not concurrent else None]
        jobs += [({"prompt_token_ids": chat_ids(tok, p)}, lora) for p in prompts]
    wall, cpu = time.perf_counter(), time.process_time()
    if concurrent:
        llm.generate([j[0] for j in jobs], params, lora_request=[j[1] for j in jobs])
    else:
        for prompt, lora in jobs:
            llm.generate([prompt], params, lora_request=lora)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    tokens = len(jobs) * NEW_TOKENS_SPEED
    return {"requests": len(jobs), "tok_s": tokens / wall, "tok_cpu_s": tokens / cpu}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/default_model.json")
    p.add_argument("--cache-dir", default=".cache/bench/default_model")
    p.add_argument("--reps", type=int, default=3, help="alternating speed rounds")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--variants",
        default="float32,int4",
        help=f"comma-separated, of {list(VARIANTS)}; answers are compared with the first",
    )
    args = p.parse_args(argv)
    names = args.variants.split(",")
    if len(names) < 2 or set(names) - set(VARIANTS):
        p.error(f"--variants: two or more of {list(VARIANTS)}, got {args.variants!r}")

    from ort_lora import LLM
    from ort_lora.bench.cli import cpu_name
    from ort_lora.demo.tasks import TASKS

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_ops import share_one_pool

    paths = exports(Path(args.cache_dir), names)
    share_one_pool(args.threads)  # the engines, timed in turn, on one thread pool
    llms = {n: LLM(str(path), intra_op_num_threads=args.threads) for n, path in paths.items()}
    doc = {
        "command": "python bench/bench_default_model.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": cpu_name(),
        "threads": args.threads,
        "loadavg_start": os.getloadavg(),
        "quality": {n: quality(llm, TASKS) for n, llm in llms.items()},
        "speed": {n: {"one_at_a_time": [], "concurrent": []} for n in llms},
    }
    for _ in range(args.reps):
        for load in ("one_at_a_time", "concurrent"):
            for name, llm in llms.items():
                doc["speed"][name][load].append(speed(llm, TASKS, load == "concurrent"))
    doc["loadavg_end"] = os.getloadavg()
    doc["agreement"] = agreement(doc["quality"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(report(doc))
    return 0


def agreement(q: dict) -> dict:
    """Per variant after the first, task and adapter/base: the share of held-out answers equal
    to the first variant's."""
    first, *others = q

    def same(task: str, other: str, w: str) -> float:
        pairs = zip(q[first][task]["answers"][w], q[other][task]["answers"][w])
        return statistics.mean(a == b for a, b in pairs)

    return {
        o: {task: {w: same(task, o, w) for w in ("adapter", "base")} for task in q[first]}
        for o in others
    }


def report(doc: dict) -> str:
    lines = [f"{doc['date']}  {doc['cpu']}  load {doc['loadavg_start'][0]:.1f}", ""]
    first = next(iter(doc["quality"]))
    header = "task       export         adapter  base   same answers as"
    lines.append(f"{header} {first} (adapter / base)")
    for task in doc["quality"][first]:
        for name, q in doc["quality"].items():
            t, same = q[task], doc["agreement"].get(name, {}).get(task)
            lines.append(
                f"{task:<10} {name:<14} {t['adapter_success']:>7.1%} {t['base_success']:>5.1%}"
                + (f"   {same['adapter']:.0%} / {same['base']:.0%}" if same else "")
            )
    lines += ["", "load           export         tok/s (median)  tok/CPU-s (median)"]
    for load in ("one_at_a_time", "concurrent"):
        for name, s in doc["speed"].items():
            runs = s[load]
            wall = statistics.median(r["tok_s"] for r in runs)
            cpu = statistics.median(r["tok_cpu_s"] for r in runs)
            lines.append(f"{load:<14} {name:<14} {wall:>14.1f} {cpu:>19.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
