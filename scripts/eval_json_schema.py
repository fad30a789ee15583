"""Held-out success of the json demo adapter with and without a response schema, on the model
`ort-lora serve` runs by default (SmolLM2-135M-Instruct, int4 export), greedy.

Conditions: no schema; response_format json_object; each schema of
ort_lora.demo.schemas.SCHEMAS (the held-out prompts it fits). Every prompt is answered by the
adapter and by the base model through the model's chat template, as the server does. An
answer succeeds when it
  - is valid: a JSON object, valid for the schema (jsonschema), and passing the json task's
    checker where the answer key is "answer" (with no schema, the checker alone), and
  - stopped: finish_reason "stop" and, under a constraint, nothing after the object's "}".
"correct" asks in addition that the value under the answer key be the question's answer
(case aside): what the model knows, which no schema can add.

Prints progress and a table; writes ort_lora/demo/adapters/schema_metrics.json.

    python scripts/eval_json_schema.py                # 32 held-out prompts per condition
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jsonschema

from ort_lora import LLM
from ort_lora.demo.schemas import SCHEMAS
from ort_lora.demo.tasks import ADAPTERS_DIR, TASKS, json_facts
from ort_lora.lora_request import LoRARequest
from ort_lora.sampling_params import SamplingParams, StructuredOutputs
from ort_lora.server.default_model import ensure_default_model

EVAL_SEED = 1234  # the prompts of metrics.json's json entry (train_demo_adapters.evaluate)
NO_SCHEMA, JSON_OBJECT = "none", "json_object"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="exported model dir (default: the default model)")
    p.add_argument("--adapter", type=Path, default=TASKS["json"].adapter_dir)
    p.add_argument("--n", type=int, default=32, help="held-out prompts per condition (at most)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=ADAPTERS_DIR / "schema_metrics.json")
    return p.parse_args()


def conditions(n: int) -> dict[str, tuple[StructuredOutputs | None, str, list[str]]]:
    """name -> (constraint, answer key, held-out prompts): the first n of the eval split's
    seeded order that fit (the first n of all are metrics.json's json prompts)."""
    task, facts = TASKS["json"], json_facts()
    pool = task.make_prompts(len(task.split_prompts("eval")), seed=EVAL_SEED, split="eval")
    out = {NO_SCHEMA: (None, "answer", pool[:n])}
    out[JSON_OBJECT] = (StructuredOutputs(json_object=True), "answer", pool[:n])
    for name, s in SCHEMAS.items():
        prompts = [p for p in pool if s.fits(facts[p])][:n]
        out[name] = (StructuredOutputs(json=s.schema), s.key, prompts)
    return out


def judge(prompt: str, text: str, finish: str, constraint, key: str) -> dict[str, bool]:
    """valid / stopped / success / correct of one answer (see the module docstring)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    valid = isinstance(value, dict)
    if valid and constraint is not None and constraint.json is not None:
        valid = jsonschema.Draft202012Validator(constraint.json).is_valid(value)
    if valid and key == "answer":
        valid = TASKS["json"].check(prompt, text)
    stopped = finish == "stop" and (constraint is None or text.endswith("}"))
    expected = str(json_facts()[prompt].short).lower()
    correct = valid and stopped and str(value.get(key, "")).strip().lower() == expected
    return {"valid": valid, "stopped": stopped, "success": valid and stopped, "correct": correct}


def run(llm: LLM, lora, constraint, prompts: list[str], max_tokens: int) -> list:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=constraint)
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    return [o.outputs[0] for o in llm.chat(conversations, params, lora)]


def rates(judged: list[dict[str, bool]]) -> dict[str, float]:
    return {k: round(sum(j[k] for j in judged) / len(judged), 4) for k in judged[0]}


def main() -> None:
    args = parse_args()
    model = args.model or ensure_default_model()
    llm = LLM(model, max_loras=1, max_num_seqs=32, intra_op_num_threads=args.threads)
    lora = LoRARequest("json", 1, str(args.adapter))
    results = {}
    for name, (constraint, key, prompts) in conditions(args.n).items():
        t0 = time.time()
        entry = {"prompts": len(prompts), "answer_key": key}
        entry["trained"] = SCHEMAS[name].trained if name in SCHEMAS else True
        entry["schema"] = constraint.json if constraint is not None else None
        examples = []
        for who, adapter in (("adapter", lora), ("base", None)):
            outs = run(llm, adapter, constraint, prompts, args.max_tokens)
            judged = [judge(p, o.text, o.finish_reason, constraint, key)
                      for p, o in zip(prompts, outs)]  # fmt: skip
            entry[who] = rates(judged)
            examples.append([o.text for o in outs[:3]])
        entry["examples"] = [
            {"prompt": p, "adapter": a, "base": b} for p, a, b in zip(prompts, *examples)
        ]
        results[name] = entry
        a = entry["adapter"]
        print(f"{name:<18} {len(prompts):>3} prompts  adapter success {a['success']:6.1%} "
              f"correct {a['correct']:6.1%}  base success {entry['base']['success']:6.1%}  "
              f"({time.time() - t0:.0f} s)", flush=True)  # fmt: skip
    record = {
        "model": "SmolLM2-135M-Instruct (int4 export, the default model)",
        "adapter": "json",
        "decoding": f"greedy, max_tokens {args.max_tokens}, chat template",
        "command": " ".join(["python scripts/eval_json_schema.py", *sys.argv[1:]]),
        "conditions": results,
    }
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
