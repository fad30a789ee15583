"""Hugging Face Optimum's route for LoRA adapters on ONNX Runtime, run by the optimum venv's
python (it imports no ort_lora):

    <venv>/bin/python -P optimum_child.py JOB.json OUT.json            measure one workload
    <venv>/bin/python -P optimum_child.py --export EXPORTS.json OUT.json   only make exports

Exports (not timed): each adapter merged into the base (PEFT `merge_and_unload`), the merged
model exported by Optimum (`ORTModelForCausalLM.from_pretrained(dir, export=True)`, past KV)
into export_dir/<export_name(adapter)>; the base model is exported the same way as "base".
EXPORTS: {model, export_dir, exports: [adapter dir or null]}; OUT: {export_s: {name: s}}.

JOB: {model, adapters, requests: [{prompt_ids, max_tokens, adapter, arrival_s}], export_dir,
threads}. Missing exports are made first (in a child process, so this one's peak RSS is the
serving's). One ORTModelForCausalLM per export used, all loaded. Requests are grouped by
adapter, groups in order of their first arrival; each group waits for its last request, then
runs as one left-padded batch (greedy, exactly max_tokens: min_new_tokens = max_new_tokens).
OUT: {token_s: [[...] per request], cpu_s and peak_rss_mb (this process tree, measured part),
version (optimum-onnx), ort_version, groups, export_s}.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASE = "base"
# copied beside the merged weights, as a user's model directory holds them
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


def export_name(adapter: str | None) -> str:
    """The export directory's name: "base", or "merged-<adapter dir name>-<hash>", the hash
    of the adapter's files, so a changed adapter gets a new export."""
    if adapter is None:
        return BASE
    digest = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        digest.update((Path(adapter) / name).read_bytes())
    return f"merged-{Path(adapter).name}-{digest.hexdigest()[:12]}"


def rope_overrides(raw_config: dict) -> dict:
    """Config attributes transformers 4.x needs from a config.json written by transformers 5,
    which keeps RoPE's theta (and scaling) under "rope_parameters": 4.x ignores that key and
    would silently run its default theta."""
    rope = raw_config.get("rope_parameters")
    if not rope or "rope_theta" in raw_config:
        return {}
    out = {"rope_theta": rope["rope_theta"]}
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


def group_by_adapter(requests: list[dict]) -> list[tuple[int | None, list[int]]]:
    """(adapter, request indices) per adapter (None: the base model), groups in order of
    their first arrival (ties: the lower request index first)."""
    groups: dict[int | None, list[int]] = {}
    for i, r in enumerate(requests):
        groups.setdefault(r["adapter"], []).append(i)
    return sorted(groups.items(), key=lambda g: min((requests[i]["arrival_s"], i) for i in g[1]))


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[list[list[int]], list[list[int]]]:
    """input_ids and attention_mask of one batch, prompts padded on the left:  # [B, S] each"""
    width = max(len(p) for p in prompts)
    ids = [[pad_id] * (width - len(p)) + list(p) for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return ids, mask


class Stamps:
    """A transformers streamer (BaseStreamer's put/end): generate() calls put() once with the
    prompt, then once per generated step; each put after the first is a step's time."""

    def __init__(self, t0: float):
        self.t0, self.prompt_seen, self.times = t0, False, []

    def put(self, value) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter() - self.t0)
        self.prompt_seen = True

    def end(self) -> None:
        pass


def token_times(stamps: list[float], max_tokens: list[int]) -> list[list[float]]:
    """Each request of one batch: the first max_tokens of the batch's step times."""
    if len(stamps) < max(max_tokens):
        raise RuntimeError(f"generate() ran {len(stamps)} steps; expected {max(max_tokens)}")
    return [stamps[:n] for n in max_tokens]


def measure(requests: list[dict], groups, run_batch) -> list[list[float]]:
    """Token times of every request (seconds from the start): groups one after another, each
    once its requests have arrived; run_batch(adapter, requests, t0) -> the step times."""
    times: list[list[float]] = [[] for _ in requests]
    t0 = time.perf_counter()
    for adapter, idx in groups:
        batch = [requests[i] for i in idx]
        time.sleep(max(0.0, max(r["arrival_s"] for r in batch) - (time.perf_counter() - t0)))
        stamps = run_batch(adapter, batch, t0)
        for i, t in zip(idx, token_times(stamps, [r["max_tokens"] for r in batch])):
            times[i] = t
    return times


def make_export(model: str, adapter: str | None, final: Path) -> float:
    """Merge `adapter` into the base (None: the base as is), save it, export it with Optimum
    into `final` (built beside it, renamed when complete); the seconds it took."""
    import torch
    from optimum.onnxruntime import ORTModelForCausalLM
    from transformers import AutoConfig, AutoModelForCausalLM

    start = time.perf_counter()
    for stale in final.parent.glob(f"{final.name}.tmp*"):  # left by a killed export
        shutil.rmtree(stale, ignore_errors=True)
    tmp = final.with_name(f"{final.name}.tmp{os.getpid()}")
    overrides = rope_overrides(json.loads((Path(model) / "config.json").read_text()))
    config = AutoConfig.from_pretrained(model, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(model, config=config, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        hf = PeftModel.from_pretrained(hf, adapter).merge_and_unload()
    hf.save_pretrained(tmp / "merged")
    for name in TOKENIZER_FILES:
        if (Path(model) / name).is_file():
            shutil.copy(Path(model) / name, tmp / "merged" / name)
    del hf
    ORTModelForCausalLM.from_pretrained(tmp / "merged", export=True).save_pretrained(tmp / "onnx")
    (tmp / "onnx").rename(final)
    shutil.rmtree(tmp)
    return time.perf_counter() - start


def export_all(job: dict) -> dict[str, float]:
    """Make every missing export of job["exports"]; {name: seconds} of those made."""
    root = Path(job["export_dir"])
    root.mkdir(parents=True, exist_ok=True)
    made = {}
    for adapter in job["exports"]:
        name = export_name(adapter)
        if (root / name).is_dir() or name in made:
            continue
        made[name] = make_export(job["model"], adapter, root / name)
        print(f"optimum: exported {name} in {made[name]:.0f}s", file=sys.stderr, flush=True)
    return made


def ensure_exports(job: dict, exports: list[str | None]) -> dict[str, float]:
    """export_all in a child process when any export is missing (its memory stays there)."""
    root = Path(job["export_dir"])
    if all((root / export_name(a)).is_dir() for a in exports):
        return {}
    spec = {"model": job["model"], "export_dir": str(root), "exports": exports}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "exports.json"
        path.write_text(json.dumps(spec))
        subprocess.run([sys.executable, "-P", __file__, "--export", path, path], check=True)
        return json.loads(path.read_text())["export_s"]


def load(path: Path, threads: int):
    import onnxruntime as ort
    from optimum.onnxruntime import ORTModelForCausalLM

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    return ORTModelForCausalLM.from_pretrained(
        path, session_options=options, provider="CPUExecutionProvider"
    )


def generate(model, requests: list[dict], pad_id: int, t0: float) -> list[float]:
    """One greedy batch of `requests`, exactly max(max_tokens) steps; each step's time."""
    import torch

    ids, mask = left_pad([r["prompt_ids"] for r in requests], pad_id)
    new = max(r["max_tokens"] for r in requests)
    stamps = Stamps(t0)
    model.generate(
        input_ids=torch.tensor(ids),
        attention_mask=torch.tensor(mask),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        num_beams=1,
        pad_token_id=pad_id,
        streamer=stamps,
    )
    return stamps.times


def _tree_helpers():
    """vllm_child.py's process-tree CPU and peak-RSS functions (this script's neighbour)."""
    spec = importlib.util.spec_from_file_location(
        "vllm_child", Path(__file__).with_name("vllm_child.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.tree_cpu_s, module.tree_peak_rss_mb


def serve(job: dict) -> dict:
    import importlib.metadata

    import onnxruntime
    import psutil
    import torch

    torch.set_num_threads(job["threads"])
    requests, adapters = job["requests"], job["adapters"]
    groups = group_by_adapter(requests)
    dirs = {a: None if a is None else adapters[a] for a, _ in groups}
    export_s = ensure_exports(job, list(dict.fromkeys(dirs.values())))
    names = {a: export_name(d) for a, d in dirs.items()}
    root = Path(job["export_dir"])
    loaded = {name: load(root / name, job["threads"]) for name in dict.fromkeys(names.values())}
    models = {a: loaded[name] for a, name in names.items()}
    pad_id = json.loads((Path(job["model"]) / "config.json").read_text()).get("pad_token_id") or 0
    warm = {"prompt_ids": [100, 101, 102, 103], "max_tokens": 2}
    for model in loaded.values():
        generate(model, [warm], pad_id, time.perf_counter())
    tree_cpu_s, tree_peak_rss_mb = _tree_helpers()
    me = psutil.Process()
    cpu0 = tree_cpu_s(me)
    token_s = measure(requests, groups, lambda a, reqs, t0: generate(models[a], reqs, pad_id, t0))
    return {
        "token_s": token_s,
        "cpu_s": tree_cpu_s(me) - cpu0,
        "peak_rss_mb": tree_peak_rss_mb(me),
        "version": importlib.metadata.version("optimum-onnx"),
        "ort_version": onnxruntime.__version__,
        "groups": len(groups),
        "export_s": export_s,
    }


def main(argv: list[str]) -> int:
    if argv[0] == "--export":
        made = export_all(json.loads(Path(argv[1]).read_text()))
        Path(argv[2]).write_text(json.dumps({"export_s": made}))
        return 0
    out = serve(json.loads(Path(argv[0]).read_text()))
    Path(argv[1]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
