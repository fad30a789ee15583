"""The end-to-end part of bench/gpu_check.py (run there, on a machine with onnxruntime-gpu).

check_end_to_end(work) exports a tiny Llama for --device cuda and for the CPU from the same
rounded weights, per dtype (float16, bfloat16), and checks: (a) every LoraSGMV and
PagedAttention node on CUDAExecutionProvider, from ORT's profile; (b) after one prefill the
device pool's K and V equal the CPU pool's; (c)/(d) 16 greedy tokens of base + 3 adapters in one
batch equal the CPU engine's, or part only at a near tie; the LoRA plan uploads per step.
engine_throughput(models) times the CUDA engine: base only vs one adapter vs distinct adapters.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import time
import traceback
from pathlib import Path

import numpy as np

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_end_to_end(work: Path, models_out: dict) -> dict:
    """(a)-(d) for float16 then bfloat16 (each runs even if the other failed); fills
    models_out[dtype] with the exports. Raises AssertionError naming every failure."""
    out, failures = {}, []
    for dtype in ("float16", "bfloat16"):
        try:
            models = models_out[dtype] = _e2e_models(work / dtype, dtype)
            session = _session_checks(models, dtype, work)  # (a), (b), the logit error
            out[dtype] = {**session, **_greedy_check(models, dtype, session["logit_err"])}
            if out[dtype]["verdict"] == "differ":
                failures.append(f"{dtype}: greedy tokens differ beyond a near tie")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            out[dtype] = {"error": f"{type(e).__name__}: {e}"}
            failures.append(f"{dtype}: {out[dtype]['error']}")
    if failures:
        raise AssertionError("; ".join(failures) + f"; results: {json.dumps(out, default=str)}")
    return out


def read_pool(rt, cuda_pool) -> np.ndarray:
    """The whole device pool, copied to the host (uint16 storage, flat)."""
    from ort_lora.runtime.cuda_layout import pool_bytes

    nbytes = pool_bytes(cuda_pool.manifest, cuda_pool.num_pages)
    host = np.empty(nbytes // 2, np.float16)
    v = ctypes.c_void_p
    rt.call("stream_synchronize", v(cuda_pool.compute_stream))
    rt.call("memcpy_async", host.ctypes.data_as(v), v(cuda_pool.base), ctypes.c_uint64(nbytes), 2,
            v(cuda_pool.copy_stream))  # fmt: skip
    rt.call("stream_synchronize", v(cuda_pool.copy_stream))
    return host if cuda_pool.manifest.dtype == "float16" else host.view(np.uint16)


def _e2e_models(work: Path, dtype: str) -> dict:
    """A random tiny Llama with weights stored in `dtype` (so the CPU float32 export and the
    CUDA export hold the same values), its two exports with the same block size, and three
    random PEFT adapters (ranks 4, 8, 16, all seven modules) stored in `dtype` too."""
    from ort_lora.contract import ModelManifest
    from ort_lora.export import export_model
    from ort_lora.export.tiny import tiny_config, write_random_checkpoint

    cfg = tiny_config("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                      max_position_embeddings=1024)  # fmt: skip
    ckpt = write_random_checkpoint(work / "ckpt", cfg, seed=1, dtype=dtype)
    gpu = export_model(ckpt, work / "cuda", device="cuda", dtype=dtype, progress=False)
    block = ModelManifest.load(gpu).block_size  # the CUDA default from head_dim (256)
    cpu = export_model(ckpt, work / "cpu", block_size=block, progress=False)
    adapters = [_write_adapter(work / f"lora{r}", cfg, r, dtype, seed=r) for r in (4, 8, 16)]
    return {"cpu": cpu, "cuda": gpu, "adapters": adapters, "block": block}


def _write_adapter(out: Path, cfg: dict, rank: int, dtype: str, seed: int) -> Path:
    """A PEFT LoRA adapter directory with random A and B (B nonzero), weights in `dtype`."""
    import torch
    from safetensors.torch import save_file

    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = (
        cfg["num_attention_heads"] * cfg["head_dim"],
        cfg["num_key_value_heads"] * cfg["head_dim"],
    )
    sizes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
             "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
             "down_proj": (inter, hidden)}  # fmt: skip
    gen, tensors = torch.Generator().manual_seed(seed), {}
    for layer in range(cfg["num_hidden_layers"]):
        for m, (n_in, n_out) in sizes.items():
            block = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{m}"
            a = torch.randn(rank, n_in, generator=gen) / n_in**0.5
            b = torch.randn(n_out, rank, generator=gen) / rank**0.5
            tensors[f"{key}.lora_A.weight"] = a.to(getattr(torch, dtype))
            tensors[f"{key}.lora_B.weight"] = b.to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(MODULES), "bias": "none"}  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def _session_checks(models: dict, dtype: str, work: Path) -> dict:
    """(a) node placement from ORT's profile of a prefill; (b) the pool's K and V after it vs
    the CPU pool; the logits of the prefill and 4 decode steps vs the CPU's (the logit error)."""
    import ort_lora
    from ort_lora.engine.model_runner import ModelRunner
    from ort_lora.engine.step_plan import base_plan
    from ort_lora.runtime.session import ModelSession

    options = ort_lora.session_options

    def profiled(**config):  # ModelSession builds its options here: profile this one session
        return options(enable_profiling=True, profile_file_prefix=str(work / dtype), **config)

    with _patched(ort_lora, "session_options", profiled):
        gpu = ModelSession(models["cuda"], 8, device="cuda")
    cpu = ModelSession(models["cpu"], 8)
    try:
        r_cpu, r_gpu, block = ModelRunner(cpu), ModelRunner(gpu), models["block"]
        rng = np.random.default_rng(2)
        a, b = (
            [int(t) for t in rng.integers(3, 250, 300)],
            [int(t) for t in rng.integers(3, 250, 21)],
        )
        plan = base_plan((a, 0, [3, 0]), (b, 0, [5]), block_size=block)  # a crosses a block
        lc, lg = r_cpu.run(plan), r_gpu.run(plan)
        errs = [_logit_err(lc, lg)]
        out = {"placement": _placement(gpu.ort_session.end_profiling())}
        out.update(_kv_check(cpu, gpu, used_pages=[3, 0, 5]))
        past, new = len(b), [int(lc[-1].argmax())]
        for _ in range(4):
            step = base_plan((new, past, [5]), block_size=block)
            lc, lg = r_cpu.run(step), r_gpu.run(step)
            errs.append(_logit_err(lc, lg))
            past, new = past + 1, [int(lc[-1].argmax())]
        out["logit_err"] = max(errs)
        out["logit_err_per_step"] = errs
        return out
    finally:
        gpu.close()
        cpu.close()


def _placement(profile_path: str) -> dict:
    """{op_type: {provider: nodes}} from ORT's profile; raises unless every LoraSGMV and
    PagedAttention node ran on CUDAExecutionProvider."""
    events = json.loads(Path(profile_path).read_text())
    nodes: dict[str, dict[str, set]] = {}
    for e in events:
        args = e.get("args", {})
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            by = nodes.setdefault(args["op_name"], {})
            by.setdefault(args.get("provider", "?"), set()).add(e["name"].split("_kernel_time")[0])
    table = {op: {p: len(n) for p, n in by.items()} for op, by in sorted(nodes.items())}
    for op in ("LoraSGMV", "PagedAttention"):
        if set(table.get(op, {})) != {"CUDAExecutionProvider"}:
            raise AssertionError(f"(a) {op} nodes by provider: {table.get(op)}; all: {table}")
    print(f"   (a) node placement: {table}")
    return table


def _kv_check(cpu, gpu, used_pages: list[int]) -> dict:
    """(b) K and V of the prefill in the device pool vs the CPU pool; unused pages stay 0."""
    from ort_lora.bfloat16 import bfloat16_bits_to_float32

    dev = read_pool(gpu.cuda_pool.rt, gpu.cuda_pool)
    dev = dev.astype(np.float32) if dev.dtype == np.float16 else bfloat16_bits_to_float32(dev)
    dev = dev.reshape(cpu.pool.shape)  # [L, 2, pages, block, kv_heads, head_dim]
    out = {}
    for half, name in ((0, "k"), (1, "v")):
        want, got = cpu.pool[:, half, used_pages], dev[:, half, used_pages]
        out[f"{name}_rel_err"] = round(float(np.abs(got - want).max() / np.abs(want).max()), 5)
    unused = np.ones(cpu.pool.shape[2], bool)
    unused[used_pages] = False
    out["unused_pages_zero"] = bool(not dev[:, :, unused].any())
    tol = 2e-2 if gpu.manifest.dtype == "float16" else 6e-2
    if max(out["k_rel_err"], out["v_rel_err"]) > tol or not out["unused_pages_zero"]:
        raise AssertionError(f"(b) device KV differs from the CPU's (tolerance {tol}): {out}")
    print(f"   (b) pool after prefill: {out}")
    return out


def _logit_err(a: np.ndarray, b: np.ndarray) -> float:
    return round(float(np.abs(a - b).max()), 5)


def _greedy_check(models: dict, dtype: str, logit_err: float) -> dict:
    """(c)/(d) 16 greedy tokens, base + 3 adapters in one batch, CPU engine vs CUDA engine."""
    from ort_lora import LLM, LoRARequest, SamplingParams
    from ort_lora.runtime.cuda_sgmv import sgmv_stats

    loras = [None] + [LoRARequest(f"l{i}", i + 1, str(p)) for i, p in enumerate(models["adapters"])]
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, 250, n)] for n in (12, 40, 7, 300)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    runs, steps = {}, {}
    for device in ("cpu", "cuda"):
        llm = LLM(models[device], device=device, num_pages=16, max_loras=3)
        session = llm.engine.runner.session
        steps[device] = _count_calls(session, "run")
        before = sgmv_stats(session.cuda_pool.rt) if device == "cuda" else None
        runs[device] = [o.outputs[0] for o in llm.generate(prompts, params, lora_request=loras)]
        if before is not None:
            after = sgmv_stats(session.cuda_pool.rt)
            uploads = {k: after[k] - before[k] for k in after}
        session.close()
    out = {"op_counters": uploads, "steps": steps["cuda"][0],
           "near_tie_margin": round(4 * logit_err, 5), "sequences": []}  # fmt: skip
    if uploads["uploads"] > len(MODULES) * steps["cuda"][0] or uploads["host_waits"]:
        raise AssertionError(f"(c) LoRA plan uploads: {uploads} over {steps['cuda'][0]} steps")
    verdicts = []
    for i, (c, g) in enumerate(zip(runs["cpu"], runs["cuda"])):
        part = next((t for t, (x, y) in enumerate(zip(c.token_ids, g.token_ids)) if x != y), None)
        entry = {"adapter": loras[i].lora_name if loras[i] else "base", "parts_at": part}
        if part is not None:
            top = sorted(c.logprobs[part].values(), key=lambda p: p.rank or 99)[:2]
            entry["cpu_top2_margin"] = round(top[0].logprob - top[1].logprob, 5)
            near = entry["cpu_top2_margin"] <= out["near_tie_margin"]
            verdicts.append("near tie" if near else "differ")
        out["sequences"].append(entry)
    out["verdict"] = "agree" if not verdicts else ("near tie" if set(verdicts) == {"near tie"}
                                                    else "differ")  # fmt: skip
    print(f"   ({'c' if dtype == 'float16' else 'd'}) greedy {dtype}: {out}")
    return out


def _count_calls(obj, name: str) -> list[int]:
    """Wraps obj.name to count its calls; returns the one-element counter list."""
    counter, real = [0], getattr(obj, name)

    def counted(*a, **kw):
        counter[0] += 1
        return real(*a, **kw)

    setattr(obj, name, counted)
    return counter


@contextlib.contextmanager
def _patched(obj, name: str, value):
    real = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, real)


def engine_throughput(models: dict) -> dict:
    """Greedy tokens/s of the CUDA engine, 64 requests x 32 tokens: base only, all on one
    adapter, and on 3 distinct adapters in turn; LoRA cost = 1 - tokens/s vs base only."""
    from ort_lora import LLM, LoRARequest, SamplingParams

    loras = [LoRARequest(f"l{i}", i + 1, str(p)) for i, p in enumerate(models["adapters"])]
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(3, 250, 64)] for _ in range(64)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm, out = LLM(models["cuda"], device="cuda", num_pages=80, max_loras=3), {}
    llm.generate(prompts[:4], params, lora_request=loras[:3] + [None])  # warm-up
    for name, lora in (("base_only", None), ("identical", [loras[0]] * 64),
                       ("uniform_3", [loras[i % 3] for i in range(64)])):  # fmt: skip
        t0 = time.perf_counter()
        llm.generate(prompts, params, lora_request=lora)
        out[f"{name}_tok_per_s"] = round(64 * 32 / (time.perf_counter() - t0), 1)
    for name in ("identical", "uniform_3"):
        out[f"{name}_lora_cost"] = round(
            1 - out[f"{name}_tok_per_s"] / out["base_only_tok_per_s"], 3
        )
    llm.engine.runner.session.close()
    return out
