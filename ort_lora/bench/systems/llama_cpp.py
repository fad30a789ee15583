"""llama.cpp's `llama-server` (built by bench/llama_cpp_build.py) on the same Q4_1 GGUF file
ort-lora's int4 export is made from, with the bench's PEFT adapters as GGUF LoRA files,
driven by the same streaming /v1/completions client as ort-lora's server
(http_server.measure_server).

Every adapter of the workload is loaded at start with scale 0 (--lora-scaled FILE:0; with
--lora, a request without a LoRA list would run with every adapter at scale 1). A request on
adapter i sends "lora": [{"id": i, "scale": 1.0}] (the GGUF's alpha / r applies on top, as
PEFT's scaling does); a base request sends an empty list, which keeps every scale at 0
(llama.cpp then builds its graph without LoRA). llama-server batches only requests whose LoRA
sets are equal: a mix of adapters runs as one batch per adapter set. Each chunk's token count
is the growth of its timings.predicted_n (timings_per_token), the server's own count.

Slots (-np): one for a one-at-a-time workload, else one per request (at most MAX_SLOTS), each
with its own KV cache (--no-kv-unified) of SLOT_CONTEXT tokens (more if a request needs it).
CPU time and peak memory (VmHWM) are the server process's.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from ort_lora.bench.llama_cpp_build import REQUIREMENT, server_version
from ort_lora.bench.metrics import RequestTimes
from ort_lora.bench.spec import RunSpec
from ort_lora.bench.systems.http_server import _free_port, measure_server
from ort_lora.bench.workloads import BenchRequest, Workload

MAX_SLOTS = 64  # as ort-lora serve's --max-num-seqs in the bench
SLOT_CONTEXT = 256  # tokens per slot: every standard workload's prompt + output fits


def slots_and_context(workload: Workload, sequential: bool) -> tuple[int, int]:
    """(slots, context per slot) for a workload: enough context for its longest request
    (prompt + output + 1), rounded up to a multiple of SLOT_CONTEXT."""
    longest = max((len(r.prompt_ids) + r.max_tokens + 1 for r in workload.requests), default=1)
    per_slot = -(-longest // SLOT_CONTEXT) * SLOT_CONTEXT
    slots = 1 if sequential else max(1, min(MAX_SLOTS, len(workload.requests)))
    return slots, per_slot


def server_command(
    binary: str,
    gguf: str,
    port: int,
    loras: list[str],
    threads: int,
    slots: int,
    slot_context: int,
) -> list[str]:
    """llama-server on 127.0.0.1:port: `threads` threads for decode and prompt batches, `slots`
    parallel sequences with continuous batching, each with `slot_context` tokens of its own KV
    cache (-c is their sum), every LoRA file loaded with scale 0 (requests set their own)."""
    cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-t", str(threads), "-tb", str(threads)]
    cmd += ["-np", str(slots), "-c", str(slots * slot_context), "--no-kv-unified", "-cb"]
    cmd += ["--no-webui"]
    for path in loras:
        if set(",:") & set(path):  # llama-server splits FILE:SCALE,... on them
            raise ValueError(
                f"LoRA file path {path!r} has a ',' or ':' (llama-server splits on them)"
            )
        cmd += ["--lora-scaled", f"{path}:0"]
    return cmd


def request_fields(r: BenchRequest) -> dict:
    """A request's body fields over the shared client's defaults: its adapter as llama-server's
    per-request LoRA list (empty: base), the running token count in every chunk, and no
    `model` or `logprobs` (one model; tokens are counted from the timings)."""
    lora = [] if r.adapter is None else [{"id": r.adapter, "scale": 1.0}]
    return {"lora": lora, "timings_per_token": True, "model": None, "logprobs": None}


def lora_files(lora_dir: str, adapters: list[str]) -> list[str]:
    """The GGUF LoRA file of each PEFT adapter dir (llama_cpp_build.convert_adapters names
    them after the dir)."""
    return [str(Path(lora_dir) / f"{Path(a).name}.gguf") for a in adapters]


def run(spec: RunSpec, workload: Workload) -> tuple[list[RequestTimes], dict]:
    binary = spec.models["llama_server"]
    sequential = spec.options.get("sequential", False)
    loras = lora_files(spec.models["llama_cpp_lora"], spec.adapters[: workload.num_adapters])
    missing = [p for p in loras if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"GGUF LoRA file {missing[0]} is missing (converted adapters)")
    port = _free_port()
    slots, per_slot = slots_and_context(workload, sequential)
    cmd = server_command(binary, spec.models["gguf"], port, loras, spec.threads, slots, per_slot)
    proc = subprocess.Popen(cmd)  # its log goes to bench.log
    url = f"http://127.0.0.1:{port}"
    times, extra = measure_server(proc, url, workload, fields=request_fields, sequential=sequential)
    extra.update(
        llama_cpp_version=server_version(Path(binary)),
        llama_cpp_source=REQUIREMENT,
        slots=slots,
        slot_context=per_slot,
    )
    return times, extra
