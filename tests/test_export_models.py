"""Exported tiny random models of every supported family vs transformers (the oracle):
prefill logits, 8 paged decode steps against transformers' own KV cache, and packed batches."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from ort_lora.engine.model_runner import ModelRunner
from ort_lora.engine.step_plan import base_plan
from ort_lora.export import export_model
from ort_lora.export.tiny import tiny_config, write_random_checkpoint
from ort_lora.export.verify import reference_step
from ort_lora.runtime import ModelSession

BLOCK = 8
ATOL = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES = {
    "llama": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "llama3_rope": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "llama_linear_rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "mistral_window": ("mistral", {"sliding_window": 5}),
    "qwen2_bias": ("qwen2", {}),
    "qwen3_qk_norm": ("qwen3", {}),
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True}),
    # tiny.TINY_FAMILY gives each of these every feature of its family: Gemma's sliding and
    # global layers, soft-capping, GeGLU, (1 + w) norms, Gemma 3's local rope base and q/k
    # norms, Phi-3's fused modules, partial rotary and LongRoPE (long factors: every sequence
    # here is longer than its original context), Granite's four multipliers
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    "phi3_longrope": ("phi3", {}),
    "phi3_window": ("phi3", {"sliding_window": 5, "rope_scaling": None}),
    "granite": ("granite", {}),
}


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tmp_path_factory):
    """(transformers model, ModelSession) of one freshly built random checkpoint."""
    from transformers import AutoModelForCausalLM

    family, overrides = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    seed = zlib.crc32(request.param.encode()) % 10_000  # hash() differs between runs
    ckpt = write_random_checkpoint(root / "ckpt", tiny_config(family, **overrides), seed=seed)
    out = export_model(ckpt, root / "export", block_size=BLOCK, progress=False)
    ref = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    return ref, ModelRunner(ModelSession(out, num_pages=24))


def _ids(rng, n: int) -> list[int]:
    return rng.integers(0, 256, size=n).tolist()


def _step(runner, *seqs) -> np.ndarray:
    """Logits of one step of hand-made sequences (token_ids, start, pages[, logit rows])."""
    return runner.run(base_plan(*seqs, block_size=runner.block_size))


def test_prefill_logits_match_transformers(exported, rng):
    ref, runner = exported
    ids = _ids(rng, 13)
    ours = _step(runner, (ids, 0, [3, 9], range(13)))
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].numpy()  # [13, vocab]
    np.testing.assert_allclose(ours, want, atol=ATOL, rtol=0)


def test_paged_decode_matches_transformers_kv_cache(exported, rng):
    """Prefill 11 tokens, then 8 greedy decode steps; 19 tokens over 3 scattered pages."""
    ref, runner = exported
    prompt = _ids(rng, 11)
    pages = [17, 4, 11]
    logits, cache = reference_step(ref, prompt)  # transformers with its own KV cache
    ours = _step(runner, (prompt, 0, pages))[0]
    np.testing.assert_allclose(ours, logits[-1], atol=ATOL, rtol=0)
    for past in range(len(prompt), len(prompt) + 8):
        token = int(logits[-1].argmax())
        logits, cache = reference_step(ref, [token], cache)
        ours = _step(runner, ([token], past, pages))[0]
        np.testing.assert_allclose(ours, logits[-1], atol=ATOL, rtol=0)


def test_packed_batch_equals_each_sequence_alone(exported, rng):
    """3 sequences of lengths 5, 12, 9: packed prefill, then a packed decode step with
    different past lengths, equal the same sequences run one at a time."""
    _, runner = exported
    prompts = [_ids(rng, n) for n in (5, 12, 9)]
    nexts = [_ids(rng, 1) for _ in prompts]
    alone_pages = [[0, 1], [2, 3], [4, 5]]
    packed_pages = [[10, 6], [12, 7], [8, 13]]  # other pages, scattered
    alone = []
    for p, nxt, pages in zip(prompts, nexts, alone_pages):
        prefill = _step(runner, (p, 0, pages, range(len(p))))
        decode = _step(runner, (nxt, len(p), pages))
        alone.append((prefill, decode))
    packed = _step(runner, *[(p, 0, pg, range(len(p))) for p, pg in zip(prompts, packed_pages)])
    packed_decode = _step(
        runner, *[(n, len(p), pg) for p, n, pg in zip(prompts, nexts, packed_pages)]
    )
    np.testing.assert_allclose(packed, np.concatenate([a[0] for a in alone]), atol=1e-5, rtol=0)
    np.testing.assert_allclose(
        packed_decode, np.concatenate([a[1] for a in alone]), atol=1e-5, rtol=0
    )


def test_tied_head_is_a_second_initializer_over_the_embedding_bytes(tmp_path):
    """A tied float32 CPU export gives the LM head's Gemm its own initializer over the
    embedding's bytes in the data file: ORT frees the original of a weight it prepacks unless
    another node (here the Gather) reads it, so one shared initializer was held twice."""
    import onnx

    cfg = tiny_config("llama", tie_word_embeddings=True)
    ckpt = write_random_checkpoint(tmp_path / "ckpt", cfg, seed=5)
    out = export_model(ckpt, tmp_path / "export", block_size=BLOCK, progress=False)
    model = onnx.load(str(out / "model.onnx"), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    head, embed = inits["lm_head.weight"], inits["model.embed_tokens.weight"]
    assert embed.external_data and list(head.external_data) == list(embed.external_data)
    uses = {n.name: list(n.input) for n in model.graph.node}
    assert uses["/lm_head/Gemm"][1] == "lm_head.weight"
    assert uses["/model/embed_tokens/Gather"][0] == "model.embed_tokens.weight"
