"""Adapter host -> pool costs on SmolLM2-135M dims: load, write_to_pool, lora_step_inputs.

A synthetic rank-16 all-linear PEFT adapter (random weights, written as safetensors, no torch)
for SmolLM2-135M: 30 layers, hidden 576, intermediate 1536, 9 heads / 3 kv heads, head_dim 64,
block 16. Prints a table and saves JSON (default results/adapter_write.json).

    python bench/bench_adapter_write.py [--rank 16] [--pages 256] [--out path]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from ort_lora.adapters import AdapterRegistry
from ort_lora.contract import LORA_MODULES, ModelManifest
from ort_lora.lora_request import LoRARequest

L, HIDDEN, INTER, HEADS, KV, HD, BLOCK = 30, 576, 1536, 9, 3, 64, 16


def smollm2_manifest() -> ModelManifest:
    q, kv = HEADS * HD, KV * HD
    dims = {"q_proj": (HIDDEN, q), "k_proj": (HIDDEN, kv), "v_proj": (HIDDEN, kv),
            "o_proj": (q, HIDDEN), "gate_proj": (HIDDEN, INTER), "up_proj": (HIDDEN, INTER),
            "down_proj": (INTER, HIDDEN)}  # fmt: skip
    return ModelManifest(
        architecture="LlamaForCausalLM", model_type="llama", num_layers=L, hidden_size=HIDDEN,
        num_heads=HEADS, num_kv_heads=KV, head_dim=HD, intermediate_size=INTER,
        vocab_size=49152, max_position_embeddings=8192, block_size=BLOCK, dtype="float32",
        device="cpu", eos_token_ids=[2],
        lora_targets={m: {"in": i, "out": o} for m, (i, o) in dims.items()},
    )  # fmt: skip


def write_adapter(path: Path, man: ModelManifest, rank: int) -> None:
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(L):
        for m in LORA_MODULES:
            block = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{m}"
            d = man.lora_targets[m]
            tensors[f"{key}.lora_A.weight"] = rng.standard_normal((rank, d["in"]), np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.standard_normal((d["out"], rank), np.float32)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(LORA_MODULES), "bias": "none"}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))


def best_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--out", default="results/adapter_write.json")
    args = ap.parse_args()
    man = smollm2_manifest()
    with tempfile.TemporaryDirectory() as tmp:
        write_adapter(Path(tmp) / "a", man, args.rank)
        reg = AdapterRegistry(man, max_cpu_loras=1)
        req = LoRARequest("a", 1, str(Path(tmp) / "a"))
        load_ms = best_ms(lambda: (reg.register(req), reg.unregister(1)), args.repeat)
        adapter = reg.register(req)
    pages = tuple(np.random.default_rng(1).permutation(args.pages)[: reg.num_pages_needed(1)])
    rows = {"rank": args.rank, "pages_needed": len(pages),
            "host_mbytes": adapter.nbytes / 2**20, "load_convert_ms": load_ms}  # fmt: skip
    for dtype in ("float32", "float16"):
        pool = np.zeros((L, 2, args.pages, BLOCK, KV, HD), dtype)
        rows[f"write_to_pool_{dtype}_ms"] = best_ms(
            lambda pool=pool: reg.write_to_pool(1, pages, pool), args.repeat
        )
    slots = [(0, 1, pages)]
    rows["step_inputs_cold_ms"] = best_ms(
        lambda: (reg.clear_step_cache(), reg.lora_step_inputs(slots, args.pages)), args.repeat
    )
    rows["step_inputs_warm_ms"] = best_ms(lambda: reg.lora_step_inputs(slots, args.pages), 100)
    for k, v in rows.items():
        print(f"{k:28s} {v:10.3f}" if isinstance(v, float) else f"{k:28s} {v:10d}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
