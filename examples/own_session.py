"""Run an exported ort-lora model in your own onnxruntime.InferenceSession.

    python examples/own_session.py MODEL_DIR [--tokens 8]

Everything the model needs is the directory written by `ort-lora export` and the custom-op
library (`ort_lora.library_path()`, registered by `ort_lora.session_options()`). This script
greedy-decodes a few tokens for one sequence, with no adapter, using only onnxruntime, numpy
and the graph contract (ort_lora/contract.py): a paged KV cache you allocate and bind once,
and small metadata inputs per step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

import ort_lora
from ort_lora import contract as C


def main(argv=None) -> list[int]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--prompt-ids", default="1,5,17,99,3", help="comma-separated token ids")
    args = ap.parse_args(argv)
    m = json.loads((args.model_dir / C.MANIFEST_NAME).read_text())
    sess = ort.InferenceSession(
        str(args.model_dir / C.MODEL_NAME), ort_lora.session_options(), ["CPUExecutionProvider"]
    )
    num_pages, bs = 16, m["block_size"]
    # the paged KV cache: [layers, K|V, pages, block, kv_heads, head_dim], bound once
    pool = np.zeros((m["num_layers"], 2, num_pages, bs, m["num_kv_heads"], m["head_dim"]), "f4")
    io = sess.io_binding()
    for layer in range(m["num_layers"]):
        io.bind_cpu_input(C.key_cache_name(layer), pool[layer, 0])
        io.bind_cpu_input(C.value_cache_name(layer), pool[layer, 1])
    io.bind_output(C.LOGITS, "cpu")
    tokens = [int(t) for t in args.prompt_ids.split(",")]
    past, new = 0, list(tokens)
    block_table = np.arange(num_pages, dtype=np.int32)[None, :]  # this sequence owns all pages
    for _ in range(args.tokens):
        pos = np.arange(past, past + len(new))
        feeds = {
            C.INPUT_IDS: np.array(new, np.int64),
            C.POSITION_IDS: pos.astype(np.int64),
            C.CU_SEQLENS: np.array([0, len(new)], np.int32),
            C.PAST_SEQLENS: np.array([past], np.int32),
            C.BLOCK_TABLE: block_table,
            C.SLOT_MAPPING: (block_table[0, pos // bs] * bs + pos % bs).astype(np.int32),
            C.LOGITS_INDICES: np.array([len(new) - 1], np.int64),
            # no adapter: one token segment in slot -1, one dummy slot of rank 0, nothing
            # composed (no lora_comp_* entries), no DoRA rows (dora_offsets -1)
            C.LORA_SEG_STARTS: np.array([0, len(new)], np.int32),
            C.LORA_SEG_SLOTS: np.array([-1], np.int32),
            C.LORA_COMP_SEGS: np.zeros(0, np.int32),
            C.LORA_COMP_SLOTS: np.zeros(0, np.int32),
            C.LORA_COMP_WEIGHTS: np.zeros(0, np.float32),
        }
        for module in m["lora_targets"]:
            feeds[C.lora_input_name(module, "a_offsets")] = np.zeros((1, 1), np.int64)
            feeds[C.lora_input_name(module, "b_offsets")] = np.zeros((1, 1), np.int64)
            feeds[C.lora_input_name(module, "ranks")] = np.zeros((m["num_layers"], 1), np.int32)
            feeds[C.lora_input_name(module, "scales")] = np.zeros((m["num_layers"], 1), "f4")
            feeds[C.lora_input_name(module, "dora_offsets")] = np.full(1, -1, np.int64)
        graph_inputs = {i.name for i in sess.get_inputs()}
        for name, value in feeds.items():
            if name in graph_inputs:
                io.bind_cpu_input(name, value)
        sess.run_with_iobinding(io)
        logits = io.copy_outputs_to_cpu()[0]  # [1, vocab]
        past += len(new)
        new = [int(logits[0].argmax())]
        tokens += new
    print("tokens:", tokens)
    return tokens


if __name__ == "__main__":
    main()
