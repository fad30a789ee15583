"""export_model: checkpoint directory or GGUF file -> ort-lora model directory.

The model directory holds model.onnx (+ model.onnx.data), ort_lora_manifest.json, tokenizer
files and generation_config.json. It is written into a temporary sibling directory and renamed
into place at the end, so a failed export never leaves a half-written OUTDIR.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from ort_lora import contract as C
from ort_lora.adapter_rows import AUTO, row_elems
from ort_lora.export.arch import ArchConfig, arch_config
from ort_lora.export.assets import make_manifest, write_generation_config, write_tokenizer
from ort_lora.export.decoder import MSFT, expected_tensor_count
from ort_lora.export.errors import ExportError
from ort_lora.export.external_data import DATA_SUFFIX, ExternalDataWriter, save_model
from ort_lora.export.families import BUILDERS
from ort_lora.export.graph import FLOAT_DTYPES, GraphBuilder
from ort_lora.export.loader import open_checkpoint
from ort_lora.export.quantizer import WEIGHTS, QuantConfig

DEVICE_DTYPES = {"cpu": ("float32",), "cuda": ("float16", "bfloat16")}
EXTRA_KEYS = {
    "max_position_embeddings": int,
    "accuracy_level": int,
    "gguf_q4_1": str,
    "int4_op": str,
    "quant_method": str,
}
QUANT_EXTRAS = ("accuracy_level", "gguf_q4_1", "int4_op", "quant_method")


def export_model(
    model_path,
    out_dir,
    *,
    lora_targets=None,
    dtype: str = "float32",
    block_size: int | None = None,
    device: str = "cpu",
    adapter_dtype: str | None = None,
    weights: str | None = None,
    quant_block_size: int = 32,
    force: bool = False,
    progress: bool = True,
    extra: dict | None = None,
) -> Path:
    """Export a local HF checkpoint dir or .gguf file to `out_dir`; returns out_dir.

    lora_targets: iterable of module names (default: all seven linear modules).
    dtype: float32 (device cpu) or float16 / bfloat16 (device cuda).
    block_size: KV block size; None: default_block_size(device, head_dim).
    adapter_dtype: how adapter rows sit in the pool: None (the default: "auto" for a float32
        export on cpu, else the pool's dtype), "auto" (each adapter's rows float16 or bfloat16
        where that type holds its values exactly, i.e. it was saved in it, else float32), the
        pool's dtype, or on cpu "int8" (a float32 scale per row, a quarter of the bytes
        LoraSGMV reads per step), "bfloat16" or "float16" (half the bytes; every adapter rounded
        to it); float32 accumulation.
    weights: None or the float dtype (weights in `dtype`), or "int4" / "int8" (cpu): base
        weights as MatMulNBits blocks of `quant_block_size` values (quantizer.py); adapters
        and activations stay float32.
    extra: rare options, e.g. {"max_position_embeddings": 8192} caps the rotary cache rows;
        quantized exports: accuracy_level (MatMulNBits, default 4), gguf_q4_1 (offset |
        zero_point), int4_op (QuantMatMul, ort_lora's int8-activation kernel for 4-bit
        linears, the default | MatMulNBits, ONNX Runtime's), quant_method (rtn | hqq: 4-bit
        weights not carried over from a GGUF refined HQQ-style, quant.quantize_hqq).
    Raises ExportError with a message for users on any bad input.
    """
    targets = _check_targets(lora_targets)
    extra = _check_extra(extra)
    _check_device_dtype(device, dtype)
    quant = _quant_config(weights, device, dtype, quant_block_size, extra)
    adapter_dtype = _check_adapter_dtype(device, dtype, adapter_dtype)
    if block_size is not None and (not isinstance(block_size, int) or block_size <= 0):
        raise ExportError(f"block size must be a positive integer, got {block_size!r}")
    out_dir = Path(out_dir).expanduser()
    _check_out_dir(out_dir, force)
    source = open_checkpoint(model_path)
    cfg = arch_config(source.config, source.generation_config)
    if "max_position_embeddings" in extra:
        cfg.max_position_embeddings = extra["max_position_embeddings"]
    if block_size is None:
        block_size = default_block_size(device, cfg.head_dim)
    _check_page_fits_rows(cfg, targets, block_size, adapter_dtype)
    if device == "cuda":
        _check_cuda_attention(cfg, block_size)
    if quant is not None:
        _check_quant_sizes(cfg, quant.block_size)
    options = dict(
        lora_targets=targets,
        dtype=dtype,
        block_size=block_size,
        device=device,
        adapter_dtype=adapter_dtype,
        quant=quant,
        extra={k: v for k, v in extra.items() if k not in QUANT_EXTRAS},
    )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the export is an ordinary directory
    try:
        options["quantization"] = _write_graph(cfg, source, tmp, options, progress)
        make_manifest(cfg, source, options).save(tmp)
        write_tokenizer(source, tmp)
        write_generation_config(source, tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _write_graph(cfg: ArchConfig, source, tmp: Path, options: dict, progress: bool) -> dict:
    """Write model.onnx + its data; the manifest's quantization entry ({} for float)."""
    from tqdm import tqdm

    writer = ExternalDataWriter(tmp / (C.MODEL_NAME + DATA_SUFFIX))
    graph = GraphBuilder(writer, f"ort_lora_{cfg.family}")
    bar = tqdm(
        total=expected_tensor_count(cfg, source.names()),
        unit="tensor",
        desc="writing tensors",
        disable=not progress,
    )
    try:
        builder = BUILDERS[cfg.family](
            cfg,
            source,
            graph,
            dtype=options["dtype"],
            device=options["device"],
            lora_targets=options["lora_targets"],
            block_size=options["block_size"],
            adapter_dtype=options["adapter_dtype"],
            quant=options["quant"],
            progress=bar,
        )
        builder.build()
    finally:
        bar.close()
        writer.close()
    opsets = {"": 17, MSFT: 1, C.OPS_DOMAIN: 1}
    save_model(graph.model(opsets), tmp / C.MODEL_NAME)
    return {} if builder.quantizer is None else builder.quantizer.summary()


def _quant_config(weights, device: str, dtype: str, block_size, extra: dict):
    """The QuantConfig of `--weights int4|int8` (None for float weights), or an ExportError
    naming the option that cannot work together with the others."""
    asked = [k for k in QUANT_EXTRAS if k in extra]
    if weights is None or weights in FLOAT_DTYPES:
        if weights is not None and weights != dtype:
            where = "cpu" if weights == "float32" else "cuda"
            raise ExportError(
                f"--weights {weights} with --dtype {dtype}: float weights are stored in the "
                f"graph's dtype; pass --dtype {weights} (device {where}) or leave --weights out"
            )
        if asked:
            raise ExportError(f"--extra {asked[0]} applies to --weights int4 / int8 only")
        return None
    if weights not in WEIGHTS:
        choices = ", ".join([*WEIGHTS, *FLOAT_DTYPES])
        raise ExportError(f"unknown --weights {weights!r}; expected one of {choices}")
    if device != "cpu" or dtype != "float32":
        raise ExportError(
            f"--weights {weights} needs --device cpu with float32 activations (got device "
            f"{device}, dtype {dtype}): this export emits ONNX Runtime's CPU MatMulNBits; "
            "a CUDA graph with quantized weights is not implemented"
        )
    config = QuantConfig(weights, block_size, **{k: extra[k] for k in asked})
    from ort_lora.export.quant_graph import check_runtime

    check_runtime(config)
    return config


def _check_quant_sizes(cfg: ArchConfig, block_size: int) -> None:
    """--block-size-q must divide the input size of every quantized weight."""
    from ort_lora.export.quant import check_divides

    check_divides(block_size, "model.embed_tokens.weight", cfg.hidden_size)
    for module, size in cfg.module_sizes().items():
        prefix = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        check_divides(block_size, f"model.layers.*.{prefix}.{module}.weight", size["in"])


def _check_targets(lora_targets) -> list[str]:
    if lora_targets is None:
        return list(C.LORA_MODULES)
    if isinstance(lora_targets, str):
        lora_targets = [t.strip() for t in lora_targets.split(",") if t.strip()]
    targets = list(dict.fromkeys(lora_targets))
    unknown = [t for t in targets if t not in C.LORA_MODULES]
    if unknown:
        raise ExportError(
            f"unknown LoRA target module(s) {', '.join(unknown)}; "
            f"expected a subset of {','.join(C.LORA_MODULES)}"
        )
    return [m for m in C.LORA_MODULES if m in targets]  # canonical order


def _check_device_dtype(device: str, dtype: str) -> None:
    if device not in DEVICE_DTYPES:
        raise ExportError(f"unknown device {device!r}; expected one of {', '.join(DEVICE_DTYPES)}")
    if dtype not in FLOAT_DTYPES:
        raise ExportError(f"unknown dtype {dtype!r}; expected one of {', '.join(FLOAT_DTYPES)}")
    if dtype not in DEVICE_DTYPES[device]:
        raise ExportError(
            f"dtype {dtype} is not supported on device {device}; "
            f"use {' or '.join(DEVICE_DTYPES[device])}"
        )


def _check_adapter_dtype(device: str, dtype: str, adapter_dtype: str | None) -> str | None:
    """The manifest's: None (rows in the pool's dtype) or, on cpu, "auto" (the default), or
    "bfloat16", "float16" or "int8" rows in the float32 pool."""
    cpu = device == "cpu"
    if adapter_dtype is None:
        return AUTO if cpu else None
    if adapter_dtype == dtype:
        return None
    if cpu and adapter_dtype in (AUTO, "bfloat16", "float16", "int8"):
        return adapter_dtype
    allowed = "auto, float32, bfloat16, float16 or int8" if cpu else dtype
    raise ExportError(
        f"adapter dtype {adapter_dtype!r} is not supported on device {device} with dtype "
        f"{dtype}; use {allowed}"
    )


def default_block_size(device: str, head_dim: int) -> int:
    """16 on cpu. On cuda the smallest block ORT's CUDA PagedAttention runs FlashAttention's
    paged kernel with (a page must hold whole kBlockN tiles: 256 tokens for head_dim <= 64, 128
    for <= 128, else 64); with smaller blocks every prefill and mixed step gathers the whole KV
    into a dense buffer for the memory-efficient kernel instead."""
    if device != "cuda":
        return 16
    return 256 if head_dim <= 64 else 128 if head_dim <= 128 else 64


def _check_cuda_attention(cfg: ArchConfig, block_size: int) -> None:
    """What ORT's CUDA com.microsoft.PagedAttention accepts (it checks at run time)."""
    if block_size < 16 or block_size & (block_size - 1):
        raise ExportError(
            f"block size {block_size}: ORT's CUDA PagedAttention needs a power of two >= 16 "
            f"(leave --block-size out for {default_block_size('cuda', cfg.head_dim)})"
        )
    if cfg.head_dim % 16:  # ORT checks head_size % 16 whenever cos/sin caches are given
        raise ExportError(
            f"head_dim {cfg.head_dim}: ORT's CUDA PagedAttention with rotary embeddings needs a "
            "multiple of 16; this model cannot be exported for --device cuda"
        )
    if cfg.rotary_dim % 16:  # partial rotary (Phi-3): cos_cache columns a multiple of 8
        raise ExportError(
            f"rotary dimension {cfg.rotary_dim}: ORT's CUDA PagedAttention needs a multiple of 16"
        )


def _check_extra(extra: dict | None) -> dict:
    out = {}
    for key, value in (extra or {}).items():
        if key not in EXTRA_KEYS:
            raise ExportError(f"unknown --extra key {key!r}; known: {', '.join(EXTRA_KEYS)}")
        try:
            out[key] = EXTRA_KEYS[key](value)
        except ValueError:
            raise ExportError(f"--extra {key}={value!r}: expected an integer") from None
    return out


def _check_out_dir(out_dir: Path, force: bool) -> None:
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ExportError(f"output path {out_dir} exists and is not a directory")
    if not any(out_dir.iterdir()):
        return
    if not force:
        raise ExportError(
            f"output directory {out_dir} already exists; pass --force (force=True) to replace it"
        )
    if not (out_dir / C.MANIFEST_NAME).is_file():
        raise ExportError(
            f"output directory {out_dir} exists and is not an ort-lora export "
            f"(no {C.MANIFEST_NAME}); refusing to replace it even with --force"
        )


def _check_page_fits_rows(
    cfg: ArchConfig, targets: list[str], block_size: int, adapter_dtype: str | None
) -> None:
    page = block_size * cfg.num_kv_heads * cfg.head_dim
    sizes = cfg.module_sizes()
    widest = max((max(sizes[m]["in"], sizes[m]["out"]) for m in targets), default=0)
    widest = row_elems(widest, adapter_dtype)  # pool elements of the widest row (auto: float32)
    if widest > page:
        need = -(-widest // (cfg.num_kv_heads * cfg.head_dim))
        raise ExportError(
            f"block size {block_size} is too small for LoRA rows of {widest} elements: a page "
            f"half holds block_size * kv_heads * head_dim = {page}; use --block-size >= {need}"
        )
