"""What an adapter costs one request decoding alone, measured in one process: requests served
one at a time (8 prompt + 64 new tokens, EOS ignored) on the default model (the int4 export
`ort-lora serve` makes of SmolLM2-135M-Instruct) without an adapter and with one of its demo
adapters, the two engines' steps taken in turn.

    python bench/bench_one_request.py --out docs/bench/one-request/zen4.json
    python bench/bench_one_request.py --adapter json --rounds 8
    python bench/bench_one_request.py --against-library OLD.so  # a change to the ops, in turn
    python bench/bench_one_request.py --prompt 2000 --against-library OLD.so  # long context

With one request there is one row a step: every LoraSGMV call reads a few tens of KB of
adapter rows, so what the op pays per call (reading its inputs from ORT, the checks, the plan)
weighs as much as its rows do. With --against-library both engines get a twin on another build
of the op library, served in the same rounds, so the change shows in both workloads (new / old)
and in the adapter's cost (adapter / base, per build). --prompt sets the prompt's length (seeded
random token ids): with a long one each decode step reads the whole context's keys and values.
Every request repeats the one prompt, so after the first its prefill comes from the prefix
cache.
Besides tok/s (prefill included) each round records the median decode step (a step that only
decoded). Prints each round and the medians, writes them (with the command, date, machine and
load) as JSON and a plot beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lora_cost import (  # noqa: E402
    VOCAB,  # noqa: F401  (the prompts' vocabulary, for their tests)
    check_in_turn_options,
    engine,
    in_turn_options,
    prompt_ids,
    run_doc,
    save_doc,
    step_in_turn,
)

PROMPT, NEW_TOKENS, REQUESTS = 8, 64, 4  # requests a round, one at a time
ADAPTERS = ("upper", "json", "numwords")  # the demo adapters
ROLES = ("base", "adapter")


def one_at_a_time(
    engines: dict, lora, tag: str, prompt: list[int]
) -> tuple[dict[str, float], dict[str, float]]:
    """REQUESTS requests of `prompt`, one at a time, on each engine (role -> engine; roles
    ending in "adapter" serve them with `lora`), the engines' steps taken in turn: each
    engine's output tok/s and its median decode step in ms."""
    from ort_lora.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    spent = dict.fromkeys(engines, 0.0)
    decode = {role: [] for role in engines}
    for i in range(REQUESTS):
        for role, eng in engines.items():
            adapter = lora if role.endswith("adapter") else None
            eng.add_request(f"{tag}-{role}-{i}", prompt, params, adapter)
        for role, seconds in step_in_turn(engines, decode)[0].items():
            spent[role] += seconds
    rates = {role: REQUESTS * NEW_TOKENS / t for role, t in spent.items()}
    return rates, {role: statistics.median(steps) * 1e3 for role, steps in decode.items()}


def ratios(rates: dict, num: str, den: str) -> dict:
    per_round = [n / d for n, d in zip(rates[num], rates[den])]
    return {"rounds": per_round, "median": statistics.median(per_round)}


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, r in doc["ratios"].items():
        rounds = range(1, len(r["rounds"]) + 1)
        ax.plot(rounds, r["rounds"], "o-", label=f"{name} (median {r['median']:.3f})")
    ax.axhline(1.0, color="gray", linestyle="--")
    ax.set(xlabel="round", ylabel="tok/s ratio")
    title = f"One request at a time, {doc['prompt_tokens']}-token prompt, adapter {doc['adapter']}"
    ax.set_title(f"{title} ({doc['isa']})", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/one_request.json")
    p.add_argument("--adapter", default="upper", choices=ADAPTERS, help="the demo adapter")
    p.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens of each request")
    in_turn_options(p, 6, f"rounds of {REQUESTS} requests each", "both engines get a twin")
    args = p.parse_args(argv)
    check_in_turn_options(p, args)
    if args.prompt < 1:
        p.error(f"--prompt must be at least 1, got {args.prompt}")

    from bench_ops import share_one_pool

    from ort_lora.server.default_model import demo_adapters, ensure_default_model

    model = ensure_default_model()
    adapters = demo_adapters()
    if args.adapter not in adapters:
        raise SystemExit(f"the demo adapter {args.adapter!r} is not installed")
    share_one_pool(args.threads)  # the engines, stepped in turn, on one thread pool
    libraries = {"": None} | ({"other ": args.against_library} if args.against_library else {})
    engines, lora = {}, None
    for prefix, library in libraries.items():
        for role in ROLES:
            eng, loras = engine(model, [adapters[args.adapter]], args.threads, library)
            engines[prefix + role], lora = eng, loras[0]
    doc = run_doc(
        "bench_one_request.py",
        args.threads,
        adapter=args.adapter,
        prompt_tokens=args.prompt,
        model=str(model),
        against_library=args.against_library,
    )
    prompt = prompt_ids(args.prompt)
    one_at_a_time(engines, lora, "warm", prompt)
    rates, steps = {role: [] for role in engines}, {role: [] for role in engines}
    for r in range(args.rounds):
        rate, step = one_at_a_time(engines, lora, str(r), prompt)
        for role in engines:
            rates[role].append(rate[role]), steps[role].append(step[role])
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items())
              + " tok/s; decode steps " + ", ".join(f"{v[-1]:.2f}" for v in steps.values())
              + " ms", flush=True)  # fmt: skip
    doc["tok_s"], doc["decode_step_ms"] = rates, steps
    doc["ratios"] = {f"{prefix}adapter / base": ratios(rates, f"{prefix}adapter", f"{prefix}base")
                     for prefix in libraries}  # fmt: skip
    if args.against_library:
        for role in ROLES:
            doc["ratios"][f"{role}: this build / other"] = ratios(rates, role, f"other {role}")
            doc["ratios"][f"{role} decode step: other / this build"] = ratios(
                steps, f"other {role}", role
            )
    doc["loadavg_end"] = os.getloadavg()
    for name, r in doc["ratios"].items():
        print(f"{name}: median {r['median']:.3f}, rounds "
              + " ".join(f"{x:.3f}" for x in r["rounds"]))  # fmt: skip
    save_doc(doc, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
