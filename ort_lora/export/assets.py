"""Files beside model.onnx: the manifest, tokenizer files and generation settings."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from ort_lora.contract import ModelManifest
from ort_lora.export.arch import ArchConfig
from ort_lora.export.loader import CheckpointSource, GGUFSource

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)
GENERATION_CONFIG = "generation_config.json"


def make_manifest(cfg: ArchConfig, source: CheckpointSource, options: dict) -> ModelManifest:
    """The ModelManifest of an export with `options` (lora_targets, dtype, block_size, ...)."""
    sizes = cfg.module_sizes()
    return ModelManifest(
        architecture=cfg.architecture,
        model_type=cfg.family,
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        block_size=options["block_size"],
        dtype=options["dtype"],
        device=options["device"],
        lora_targets={m: sizes[m] for m in options["lora_targets"]},
        eos_token_ids=cfg.eos_token_ids,
        bos_token_id=cfg.bos_token_id,
        sliding_window=cfg.sliding_window,
        source=str(source.path),
        extra=dict(options.get("extra") or {}),
        adapter_dtype=options.get("adapter_dtype"),
        fused_modules=cfg.fused_modules,
        quantization=dict(options.get("quantization") or {}),
    )


def write_tokenizer(source: CheckpointSource, out_dir: Path) -> list[str]:
    """Copy (HF dir) or build (GGUF) the tokenizer files; returns the file names written."""
    if isinstance(source, GGUFSource):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
        tok.save_pretrained(str(out_dir))
    else:
        for name in TOKENIZER_FILES:
            if (source.path / name).is_file():
                shutil.copy2(source.path / name, out_dir / name)
    _embed_chat_template(out_dir)
    written = sorted(name for name in TOKENIZER_FILES if (out_dir / name).is_file())
    if "tokenizer.json" not in written and "tokenizer.model" not in written:
        print(f"warning: no tokenizer found in {source.path}; the export has none", file=sys.stderr)
    return written


def write_generation_config(source: CheckpointSource, out_dir: Path) -> None:
    """generation_config.json: the checkpoint's sampling defaults and eos/bos ids."""
    gen = {k: v for k, v in source.generation_config.items() if not k.startswith("_")}
    if gen:
        (out_dir / GENERATION_CONFIG).write_text(json.dumps(gen, indent=2, default=str) + "\n")


def _embed_chat_template(out_dir: Path) -> None:
    """Also put the chat template inside tokenizer_config.json (transformers 5 writes it to
    chat_template.jinja only; older readers look for the key)."""
    config_path, template = out_dir / "tokenizer_config.json", out_dir / "chat_template.jinja"
    if not (config_path.is_file() and template.is_file()):
        return
    config = json.loads(config_path.read_text())
    if "chat_template" not in config:
        config["chat_template"] = template.read_text()
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
