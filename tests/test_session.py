"""The step session: pool bound once and written in place, and LoRA wiring of the exported
graph (adapter rows placed in pool pages) against a merged-weights transformers model. Plans
are made by hand (step_plan.base_plan) and run through the engine's ModelRunner."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ort_lora import contract as C
from ort_lora.adapters.compose import composition_entries
from ort_lora.engine.model_runner import ModelRunner
from ort_lora.engine.step_plan import base_plan, build_metadata
from ort_lora.export.verify import reference_step
from ort_lora.runtime import ModelSession

NUM_PAGES = 24
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def session(tiny_llama_export):
    return ModelSession(tiny_llama_export, num_pages=NUM_PAGES, intra_op_num_threads=1)


@pytest.fixture(scope="module")
def reference(tiny_llama_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_checkpoint), dtype=torch.float32)


def test_pool_is_bound_once_and_written_in_place(session, tiny_llama_checkpoint, rng):
    """After a prefill, layer 0's value cache holds V = rmsnorm(embed) @ Wv^T at the slots of
    the tokens (V has no rotary), in the same numpy buffer; other pages stay untouched."""
    from safetensors.numpy import load_file

    w = load_file(str(tiny_llama_checkpoint / "model.safetensors"))
    pool_ptr = session.pool.__array_interface__["data"][0]
    session.pool[...] = 0
    ids = rng.integers(0, 256, size=11).tolist()
    bs = session.manifest.block_size
    ModelRunner(session).run(base_plan((ids, 0, [13, 6]), block_size=bs))
    x = w["model.embed_tokens.weight"][ids]  # [T, hidden]
    gamma = w["model.layers.0.input_layernorm.weight"]  # [hidden]
    x = x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * gamma
    v = x @ w["model.layers.0.self_attn.v_proj.weight"].T  # [T, kv_heads * head_dim]
    m = session.manifest
    written = session.pool[0, 1][[13] * bs + [6] * 3, list(range(bs)) + [0, 1, 2]]
    np.testing.assert_allclose(written.reshape(11, -1), v, atol=1e-5)
    assert session.pool.__array_interface__["data"][0] == pool_ptr
    untouched = np.ones(NUM_PAGES, bool)
    untouched[[13, 6]] = False
    assert not session.pool[:, :, untouched].any()
    assert session.pool.shape == (m.num_layers, 2, NUM_PAGES, bs, m.num_kv_heads, m.head_dim)
    assert session.timing.run_s > 0 and session.timing.host_s >= 0


def _place_adapter(session, rank: int, first_page: int, rng):
    """Random A [r, in], B [out, r] per module and layer, rows packed into page halves from
    first_page on (never straddling one). Returns (adapter weights, LoRA graph inputs)."""
    m = session.manifest
    half, n_half = m.page_elems, NUM_PAGES * m.page_elems
    flat = session.pool.reshape(m.num_layers, 2 * n_half)  # a view: key half then value half
    cursor = [first_page * half]  # walks key pages first_page.., then the same value pages

    def alloc(length: int) -> int:
        if cursor[0] % half + length > half:
            cursor[0] += half - cursor[0] % half
        if n_half <= cursor[0] < n_half + first_page * half:  # key pages full: value pages
            cursor[0] = n_half + first_page * half
        start, cursor[0] = cursor[0], cursor[0] + length
        return start

    weights, inputs = {}, {}
    for module, size in m.lora_targets.items():
        a_off = [alloc(size["in"]) for _ in range(rank)]
        b_off = [alloc(size["out"]) for _ in range(rank)]
        for layer in range(m.num_layers):
            a = rng.standard_normal((rank, size["in"])).astype(np.float32) * 0.2
            b = rng.standard_normal((size["out"], rank)).astype(np.float32) * 0.2
            for j in range(rank):
                flat[layer, a_off[j] : a_off[j] + size["in"]] = a[j]
                flat[layer, b_off[j] : b_off[j] + size["out"]] = b[:, j]
            weights[(module, layer)] = (a, b)
        inputs[C.lora_input_name(module, "a_offsets")] = np.asarray([a_off], np.int64)
        inputs[C.lora_input_name(module, "b_offsets")] = np.asarray([b_off], np.int64)
        inputs[C.lora_input_name(module, "ranks")] = np.full((m.num_layers, 1), rank, np.int32)
        scales = 0.5 + rng.random((m.num_layers, 1)).astype(np.float32)
        inputs[C.lora_input_name(module, "scales")] = scales
        inputs[C.lora_input_name(module, "dora_offsets")] = np.full(1, -1, np.int64)  # no DoRA
    return weights, inputs | composition_entries()  # nothing composed


def test_lora_segments_match_merged_weights(session, reference, tiny_llama_checkpoint, rng):
    """Packed batch: sequence 0 with an adapter in slot 0, sequence 1 base only. Each equals
    transformers with W + scale * B @ A merged (resp. the base model)."""
    from transformers import AutoModelForCausalLM

    session.pool[...] = 0
    weights, lora = _place_adapter(session, rank=4, first_page=12, rng=rng)
    p0, p1 = rng.integers(0, 256, 9).tolist(), rng.integers(0, 256, 6).tolist()
    bs = session.manifest.block_size
    plan = base_plan((p0, 0, [0, 1], range(9)), (p1, 0, [2], range(6)), block_size=bs)
    inputs = build_metadata(plan, bs) | lora
    inputs[C.LORA_SEG_STARTS] = np.asarray([0, 9, 15], np.int32)
    inputs[C.LORA_SEG_SLOTS] = np.asarray([0, -1], np.int32)
    ours = session.run(inputs)  # [15, vocab]

    merged = AutoModelForCausalLM.from_pretrained(str(tiny_llama_checkpoint), dtype=torch.float32)
    with torch.no_grad():
        for (module, layer), (a, b) in weights.items():
            block = merged.model.layers[layer]
            parent = block.mlp if module in MLP_MODULES else block.self_attn
            linear = getattr(parent, module)
            scale = float(lora[C.lora_input_name(module, "scales")][layer, 0])
            linear.weight += torch.from_numpy(scale * b @ a)
    want0, _ = reference_step(merged.eval(), p0)
    want1, _ = reference_step(reference.eval(), p1)
    np.testing.assert_allclose(ours[:9], want0, atol=1e-4, rtol=0)
    np.testing.assert_allclose(ours[9:], want1, atol=1e-4, rtol=0)
    assert np.abs(want0 - reference_step(reference, p0)[0]).max() > 1e-2  # the adapter matters


def test_session_rejects_bad_arguments(tiny_llama_export, tmp_path):
    with pytest.raises(ValueError, match="num_pages must be positive"):
        ModelSession(tiny_llama_export, num_pages=0)
    with pytest.raises(FileNotFoundError, match="not an exported ort-lora model"):
        ModelSession(tmp_path, num_pages=4)


def test_read_only_inputs_given_again_are_not_bound_again(tiny_llama_export, rng):
    """An input given as the same read-only array as in the run before (the registry's cached
    LoRA tables) is not bound again: ORT reads that array's own memory. New and writeable arrays
    are bound every run; every run computes with what it was given."""
    sess = ModelSession(tiny_llama_export, num_pages=NUM_PAGES, intra_op_num_threads=1)
    _, lora = _place_adapter(sess, rank=4, first_page=12, rng=rng)
    for table in lora.values():
        table.setflags(write=False)
    bound = []
    bind = sess.binding.bind_cpu_input
    sess.binding.bind_cpu_input = lambda name, arr: (bound.append(name), bind(name, arr))[1]
    bs = sess.manifest.block_size
    plan = base_plan((rng.integers(0, 256, 9).tolist(), 0, [0, 1], range(9)), block_size=bs)

    def step(slot: int, **tables) -> np.ndarray:
        bound.clear()
        inputs = build_metadata(plan, bs) | lora | tables
        inputs[C.LORA_SEG_STARTS] = np.asarray([0, 9], np.int32)
        inputs[C.LORA_SEG_SLOTS] = np.asarray([slot], np.int32)
        return sess.run(inputs)

    first = step(0)
    assert set(lora) <= set(bound)
    np.testing.assert_array_equal(step(0), first)
    assert bound and not set(bound) & set(lora)  # the metadata is new each run, the tables not
    assert np.abs(step(-1) - first).max() > 1e-3  # the adapter's slot taken away: rebound
    scales = next(name for name in lora if name.endswith("_scales"))
    writeable = lora[scales].copy()
    for _ in range(2):
        step(0, **{scales: writeable})
        assert scales in bound
