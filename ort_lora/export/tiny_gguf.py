"""A GGUF file from a (tiny) Llama checkpoint directory, for tests of GGUF reading: each
tensor stored in a GGML type of the caller's choice, as llama.cpp's converter lays it out
(q_proj / k_proj rows permuted for its rotary layout), with the byte-level tokenizer of
tiny_tokenizer.py as a "gpt2" GGUF tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np


def permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (the inverse of transformers' reverse_permute_weights)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_llama_gguf(
    checkpoint: Path, out: Path, ggml_type: Callable[[str], str] = lambda name: "F32"
) -> Path:
    """Write `checkpoint` (config.json + model.safetensors, a Llama) as the GGUF file `out`;
    `ggml_type(hf_tensor_name)` names each tensor's GGML type ("F32", "Q4_0", "Q4_1", "Q8_0",
    ...; a type the gguf package cannot quantize is written as zero bytes). Returns `out`."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((Path(checkpoint) / "config.json").read_text())
    tensors = load_file(str(Path(checkpoint) / "model.safetensors"))
    layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    writer = gguf.GGUFWriter(str(out), "llama")
    _write_config(writer, config)
    _write_tokenizer(writer, Path(checkpoint), config)
    for hf_name, w in tensors.items():
        base, suffix = hf_name.rsplit(".", 1)
        w = w.astype(np.float32)
        if base.endswith("q_proj"):
            w = permute_for_gguf(w, config["num_attention_heads"])
        elif base.endswith("k_proj"):
            w = permute_for_gguf(w, config["num_key_value_heads"])
        qtype = gguf.GGMLQuantizationType[ggml_type(hf_name) if w.ndim == 2 else "F32"]
        data = _stored(w, qtype)
        writer.add_tensor(
            f"{names.get_name(base)}.{suffix}", data, raw_shape=data.shape, raw_dtype=qtype
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


def _stored(w: np.ndarray, qtype) -> np.ndarray:
    """w in GGML type qtype; zero bytes of the right size for a type gguf cannot quantize."""
    import gguf

    if qtype == gguf.GGMLQuantizationType.F32:
        return w
    try:
        return gguf.quants.quantize(w, qtype)
    except NotImplementedError:
        return np.zeros(gguf.quant_shape_to_byte_shape(w.shape, qtype), dtype=np.uint8)


def _write_config(writer, c: dict) -> None:
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_vocab_size(c["vocab_size"])
    writer.add_rope_dimension_count(c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]))


def _write_tokenizer(writer, checkpoint: Path, c: dict) -> None:
    vocab = json.loads((checkpoint / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i < 3 else 1 for i in range(len(tokens))])  # control, normal
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(c["bos_token_id"])
    writer.add_eos_token_id(c["eos_token_id"])
    writer.add_pad_token_id(0)
