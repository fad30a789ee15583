"""Time to first token of one long prompt, measured in one process: a request of N prompt tokens
(seeded random token ids, new ones every round: no prefix-cache hit, every token prefilled) and
one new token, served alone on the default model (the int4 export `ort-lora serve` makes of
SmolLM2-135M-Instruct) for each prompt length in turn.

    python bench/bench_prefill.py --out docs/bench/prefill/zen4.json
    python bench/bench_prefill.py --prompts 250,500,1000,2000,4000 --rounds 5
    python bench/bench_prefill.py --against-library OLD.so  # a change to the ops, in turn
    python bench/bench_prefill.py --llama-cpp  # llama.cpp's llama-server on the same GGUF
    python bench/bench_prefill.py --adapter upper --against-library OLD.so  # with a demo adapter

With one request, its time to first token is its prompt's prefill: the projections grow with
the prompt's length and attention with its square (every token attends to the tokens before
it), so long prompts show what PagedAttention costs. With --against-library a twin engine on
another build of the op library serves the same prompts in the same rounds, the two engines'
steps taken in turn, so a change to the ops shows as a ratio of times measured seconds apart.
With --llama-cpp, llama.cpp's llama-server (built once into --cache-dir, as `ort-lora bench
--experiments gguf` builds it) serves the same prompts on the Q4_1 GGUF file the default model
is exported from, with as many threads, one slot and its prompt cache off, after the engines
in each round: its time is the wall clock of one /completion request (n_predict 1), HTTP
included, the engines' that of their steps in the process. With --adapter every prompt runs on
that demo adapter (float16 rows, as `ort-lora serve` serves it): what LoRA adds to a prefill.
Prints each round, the median time to first token and prefill rate per length, writes them
(with the command, date, machine and load) as JSON and a plot of time against prompt length
beside it.
"""

from __future__ import annotations

import argparse
import contextlib
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
from bench_one_request import ADAPTERS as DEMO_ADAPTERS  # noqa: E402

PROMPTS = (500, 1000, 2000)  # --prompts' default
MAX_PROMPT = 8000  # the engines' context holds prompts up to this many tokens


def first_tokens(engines: dict, prompt: list[int], tag: str, lora=None) -> dict[str, float]:
    """One request of `prompt` (on adapter `lora`, a LoRARequest, if given) and one new token
    on each engine (role -> engine), their steps taken in turn: each engine's seconds to its
    first token."""
    from ort_lora.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for role, eng in engines.items():
        eng.add_request(f"{tag}-{role}", prompt, params, lora)
    return step_in_turn(engines)[0]


def one_round(
    engines: dict, lengths: list[int], r: int, servers: dict | None = None, lora=None
) -> dict[str, dict[int, float]]:
    """Round r: a prompt of each length (ids seeded by round and length, the same for all) on
    each engine (on adapter `lora` if given), then on each of `servers` (role -> function of a
    prompt: its seconds to first token): role -> length -> seconds to first token."""
    servers = servers or {}
    out = {role: {} for role in [*engines, *servers]}
    for n in lengths:
        prompt = prompt_ids(n, r * MAX_PROMPT + n)
        for role, seconds in first_tokens(engines, prompt, f"{r}-{n}", lora).items():
            out[role][n] = seconds
        for role, first_token in servers.items():
            out[role][n] = first_token(prompt)
    return out


def summary(ttft: dict, lengths: list[int]) -> dict:
    """Per role and length: median seconds to first token and prefill tok/s; for every role
    but "this", its time / this build's per length (the rounds' and their median)."""
    doc = {"median_ttft_s": {}, "prefill_tok_s": {}, "over_this": {}}
    for role, by_len in ttft.items():
        doc["median_ttft_s"][role] = {n: statistics.median(by_len[n]) for n in lengths}
        doc["prefill_tok_s"][role] = {n: n / doc["median_ttft_s"][role][n] for n in lengths}
        if role != "this":
            doc["over_this"][role] = {}
            for n in lengths:
                rounds = [o / t for o, t in zip(by_len[n], ttft["this"][n])]
                doc["over_this"][role][n] = {"rounds": rounds, "median": statistics.median(rounds)}
    return doc


class LlamaServer:
    """llama.cpp's llama-server on `gguf`, one slot of `context` tokens, `threads` threads (as
    the bench's llama-cpp system starts it), for `with`: first_token(prompt) is the seconds one
    /completion request of the prompt's token ids and one new token takes, the server's prompt
    cache off."""

    def __init__(self, binary: Path, gguf: Path, threads: int, context: int):
        from ort_lora.bench.systems.http_server import _free_port
        from ort_lora.bench.systems.llama_cpp import server_command

        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.command = server_command(str(binary), str(gguf), port, [], threads, 1, context)

    def __enter__(self) -> LlamaServer:
        import subprocess

        from ort_lora.bench.systems.http_server import wait_healthy

        self.proc = subprocess.Popen(
            self.command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        try:
            wait_healthy(self.proc, self.url)
        except BaseException:
            self.proc.kill()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)

    def first_token(self, prompt: list[int]) -> float:
        import time

        import httpx

        body = {"prompt": prompt, "n_predict": 1, "cache_prompt": False, "temperature": 0.0}
        start = time.perf_counter()
        reply = httpx.post(f"{self.url}/completion", json=body, timeout=600)
        seconds = time.perf_counter() - start
        reply.raise_for_status()
        prefilled = reply.json()["timings"]["prompt_n"]
        if prefilled != len(prompt):  # its prompt cache answered the rest
            raise RuntimeError(f"llama-server prefilled {prefilled} of {len(prompt)} tokens")
        return seconds


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for role, by_len in doc["median_ttft_s"].items():
        label = {"this": "ort-lora, this build", "other": "ort-lora, other build"}.get(role, role)
        ax.plot(list(by_len), list(by_len.values()), "o-", label=label)
    ax.set(xlabel="prompt tokens", ylabel="time to first token (s)")
    ax.set_title(f"One prompt alone, default model, {doc['threads']} threads ({doc['isa']})",
                 fontsize=10)  # fmt: skip
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_lengths(text: str) -> list[int]:
    lengths = [int(x) for x in text.split(",") if x.strip()]
    if not lengths or any(not 1 <= n <= MAX_PROMPT for n in lengths):
        raise ValueError
    return lengths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="results/prefill.json")
    p.add_argument(
        "--prompts",
        default=",".join(map(str, PROMPTS)),
        help=f"prompt lengths in tokens, comma-separated (1 to {MAX_PROMPT})",
    )
    in_turn_options(p, 3, "rounds of one prompt per length", "a twin engine")
    p.add_argument(
        "--llama-cpp",
        action="store_true",
        help="also llama.cpp's llama-server on the same GGUF (built into --cache-dir if needed)",
    )
    p.add_argument("--cache-dir", default=".cache/bench", help="where llama.cpp is built")
    p.add_argument(
        "--adapter",
        choices=DEMO_ADAPTERS,
        help="every prompt on this demo adapter (ort-lora's engines only: not with --llama-cpp)",
    )
    args = p.parse_args(argv)
    if args.adapter and args.llama_cpp:
        p.error("--adapter: llama.cpp would serve the prompts without it; leave out --llama-cpp")
    try:
        lengths = parse_lengths(args.prompts)
    except ValueError:
        p.error(f"--prompts takes lengths from 1 to {MAX_PROMPT}, got {args.prompts!r}")
    check_in_turn_options(p, args)

    from bench_ops import share_one_pool

    from ort_lora.server.default_model import (
        default_gguf_path,
        demo_adapters,
        ensure_default_model,
    )

    model = ensure_default_model()
    served = []
    if args.adapter:
        adapters = demo_adapters()
        if args.adapter not in adapters:
            raise SystemExit(f"the demo adapter {args.adapter!r} is not installed")
        served = [adapters[args.adapter]]
    servers, doc_extra, stack = {}, {}, contextlib.ExitStack()
    if args.llama_cpp:
        from ort_lora.bench import llama_cpp_build

        binary, why = llama_cpp_build.ensure(Path(args.cache_dir))
        if binary is None:
            raise SystemExit(f"--llama-cpp: {why}")
        context = max(lengths) + 64
        server = stack.enter_context(
            LlamaServer(binary, default_gguf_path(), args.threads, context)
        )
        servers["llama.cpp"] = server.first_token
        doc_extra["llama_cpp"] = {
            "version": llama_cpp_build.server_version(binary),
            "source": llama_cpp_build.REQUIREMENT,
            "command": server.command,
        }
    share_one_pool(args.threads)  # the engines, stepped in turn, on one thread pool
    libraries = {"this": None} | ({"other": args.against_library} if args.against_library else {})
    engines, lora = {}, None
    for role, library in libraries.items():
        engines[role], loras = engine(model, served, args.threads, library)
        lora = loras[0] if loras else None
    doc = run_doc(
        "bench_prefill.py",
        args.threads,
        prompts=lengths,
        model=str(model),
        adapter=args.adapter,
        against_library=args.against_library,
        **doc_extra,
    )
    roles = [*engines, *servers]
    ttft = {role: {n: [] for n in lengths} for role in roles}
    with stack:
        warm = prompt_ids(64, 0)  # seed 0: no round's
        first_tokens(engines, warm, "warm", lora)
        for first_token in servers.values():
            first_token(warm)
        for r in range(args.rounds):
            for role, by_len in one_round(engines, lengths, r, servers, lora).items():
                for n, seconds in by_len.items():
                    ttft[role][n].append(seconds)
            print(f"round {r + 1}: " + "; ".join(
                f"{n} tokens " + ", ".join(f"{role} {ttft[role][n][-1]:.3f}" for role in roles)
                for n in lengths) + " s", flush=True)  # fmt: skip
    doc["ttft_s"] = ttft
    doc.update(summary(ttft, lengths))
    doc["loadavg_end"] = os.getloadavg()
    ttft_s, rate = doc["median_ttft_s"], doc["prefill_tok_s"]
    for n in lengths:
        line = f"{n} prompt tokens: " + ", ".join(
            f"{role} {ttft_s[role][n]:.3f} s ({rate[role][n]:.0f} tok/s)" for role in roles
        )
        for role, by_len in doc["over_this"].items():
            line += f"; {role} / this {by_len[n]['median']:.3f}"
        print(line)
    save_doc(doc, args.out, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
