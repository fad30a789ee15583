"""`ort-lora export MODEL OUTDIR [options]`: errors print a message and exit non-zero."""

from __future__ import annotations

import argparse
import json
import os
import sys

from ort_lora.adapter_rows import AUTO, ROW_TYPES
from ort_lora.contract import LORA_MODULES, MANIFEST_NAME
from ort_lora.export.errors import ExportError

VERIFY_EXTRAS = {"verify_tol": float, "verify_steps": int, "verify_prompts": int}
DEFAULT_VERIFY_TOL = 1e-3


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ort-lora export",
        description="Export a local Hugging Face checkpoint directory or .gguf file to an "
        "ort-lora model directory (ONNX graph, manifest, tokenizer).",
    )
    p.add_argument("model", help="checkpoint directory (config.json + *.safetensors) or .gguf")
    p.add_argument("outdir", help="output directory")
    p.add_argument(
        "--lora-targets",
        default=",".join(LORA_MODULES),
        help="comma list of LoRA target modules (default: all seven)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="float32 (cpu, default) or float16/bfloat16 (cuda, default float16)",
    )
    p.add_argument(
        "--weights",
        default=None,
        choices=("int4", "int8", "float32", "float16", "bfloat16"),
        help="base weights: the graph's dtype (default), or int4 / int8 (cpu) as ONNX "
        "Runtime MatMulNBits blocks (int4: multiplied by ort_lora's QuantMatMul, the 8-bit LM "
        "head too), LoRA adapters still float32 (GGUF Q4_0 / Q4_1 / Q8_0 "
        "blocks carried over, other weights quantized round-to-nearest)",
    )
    p.add_argument(
        "--block-size-q",
        type=int,
        default=32,
        help="values per quantization block with --weights int4/int8 (a power of two >= 16 "
        "that divides every layer's input size; default 32, GGUF's block)",
    )
    p.add_argument(
        "--adapter-dtype",
        default=None,
        choices=(AUTO, *ROW_TYPES),
        help="adapter rows in the pool: on cpu auto (the default: each adapter's rows float16 "
        "or bfloat16 when it was saved in that type, half the bytes per step and exact, else "
        "float32), float32, bfloat16 or float16 (every adapter rounded to it) or int8 (a "
        "quarter of the bytes: one float32 scale per row); on cuda the model dtype; float32 "
        "accumulation",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="KV block size (default: 16 on cpu; on cuda 256 for head_dim <= 64, 128 for <= 128, "
        "else 64, what ORT's FlashAttention paged kernel needs)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="the provider the graph is for (cuda: compiled, not yet run end to end on a GPU; "
        "docs/CUDA.md)",
    )
    p.add_argument("--force", action="store_true", help="replace an existing export in OUTDIR")
    p.add_argument(
        "--verify",
        action="store_true",
        help="compare logits with transformers after export (prefill + decode)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="rare options: max_position_embeddings=N, verify_tol=X, verify_steps=N, "
        "verify_prompts=N; with --weights int4/int8: accuracy_level=0|1|4 (MatMulNBits, "
        "default 4: int8 activations), gguf_q4_1=offset|zero_point, "
        "int4_op=QuantMatMul|MatMulNBits (4-bit linears and the LM head: ort_lora's kernel, "
        "the default, or ORT's), "
        "quant_method=rtn|hqq (int4: round-to-nearest, or refined HQQ-style)",
    )
    return p


def parse_extra(items: list[str]) -> tuple[dict, dict]:
    """(export extras, verify extras) from KEY=VALUE strings."""
    export, verify = {}, {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ExportError(f"--extra expects KEY=VALUE, got {item!r}")
        if key in VERIFY_EXTRAS:
            try:
                verify[key] = VERIFY_EXTRAS[key](value)
            except ValueError:
                raise ExportError(f"--extra {key}={value!r}: expected a number") from None
        else:
            export[key] = value
    return export, verify


def run(args: argparse.Namespace) -> int:
    from ort_lora.export.exporter import export_model

    extra, verify_opts = parse_extra(args.extra)
    floats = ("float32", "float16", "bfloat16")
    dtype = args.dtype or (args.weights if args.weights in floats else None)
    dtype = dtype or ("float32" if args.device == "cpu" else "float16")
    out = export_model(
        args.model,
        args.outdir,
        lora_targets=args.lora_targets,
        dtype=dtype,
        block_size=args.block_size,
        device=args.device,
        adapter_dtype=args.adapter_dtype,
        weights=args.weights,
        quant_block_size=args.block_size_q,
        force=args.force,
        progress=not args.quiet,
        extra=extra,
    )
    print(f"exported {args.model} -> {out}")
    if not args.verify:
        return 0
    from ort_lora.export.verify import verify_export

    tol = verify_opts.get("verify_tol", DEFAULT_VERIFY_TOL)
    size = dict(
        num_prompts=verify_opts.get("verify_prompts", 3), steps=verify_opts.get("verify_steps", 8)
    )
    quant = json.loads((out / MANIFEST_NAME).read_text()).get("quantization") or {}
    checked = "" if not quant else " on its dequantized weights, accuracy_level 0"
    level = 0 if quant else None
    diff = verify_export(args.model, out, accuracy_level=level, progress=not args.quiet, **size)
    ok = diff <= tol
    print(
        f"verify: max |logits - transformers{checked}| = {diff:.3g} (tolerance {tol:g}): "
        f"{'OK' if ok else 'FAILED'}"
    )
    if quant and quant["accuracy_level"] != 0:
        served = verify_export(args.model, out, **size)
        print(
            f"verify: as served (accuracy_level {quant['accuracy_level']}: int8 inputs) "
            f"max |logits - transformers on its dequantized weights| = {served:.3g} "
            "(the inputs' int8 rounding; not checked)"
        )
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of `ort-lora export`; returns the exit code."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # argparse printed the usage error (or --help)
        return int(e.code or 0)
    try:
        return run(args)
    except ExportError as e:
        print(f"ort-lora export: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ort-lora export: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # never a stack trace for users; ORT_LORA_DEBUG=1 shows it
        if os.environ.get("ORT_LORA_DEBUG"):
            raise
        print(
            f"ort-lora export: error: {type(e).__name__}: {e} "
            "(set ORT_LORA_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
