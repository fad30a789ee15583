"""Quantized exports (--weights int4 / int8): the block layout against ONNX Runtime's own
MatMulNBits, GGUF blocks carried over exactly, the tiny Llama against transformers on its
dequantized weights (tolerances: quant_cases.py), bad input, and the SmolLM2 GGUF as int4."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import replace

import numpy as np
import onnx
import pytest
from quant_cases import ATOL, assert_rows_match, export_quantized, reference

from ort_lora.engine.model_runner import ModelRunner
from ort_lora.engine.step_plan import base_plan
from ort_lora.export import ExportError
from ort_lora.export.cli import main as export_main
from ort_lora.export.external_data import ExternalDataWriter
from ort_lora.export.gguf_blocks import map_blocks
from ort_lora.export.graph import GraphBuilder
from ort_lora.export.quant import (
    BlockQuantized,
    quantize_activations,
    quantize_hqq,
    quantize_rtn,
)
from ort_lora.export.quant_graph import QuantGraph
from ort_lora.export.tiny import tiny_config, write_random_checkpoint
from ort_lora.export.tiny_gguf import write_llama_gguf
from ort_lora.export.verify import at_accuracy_level, reference_step, verify_export
from ort_lora.runtime import ModelSession


def _run_node(tmp_path, q: BlockQuantized, x: np.ndarray, accuracy_level: int, gather=False):
    """ORT's output of one MatMulNBits (x [T, K] @ W^T) or GatherBlockQuantized (rows x)."""
    import onnxruntime as ort

    writer = ExternalDataWriter(tmp_path / "m.onnx.data")
    g = GraphBuilder(writer, "one_node")
    qg = QuantGraph(g, accuracy_level)
    if gather:
        g.input("x", "int64", ["T"])
        y = qg.gather("x", q, "w", "/gather")
    else:
        g.input("x", "float32", ["T", q.shape[1]])
        y = qg.matmul("x", q, "w", "/linear")
    g.output(y, "float32", None)
    writer.close()
    (tmp_path / "m.onnx").write_bytes(g.model({"": 17, "com.microsoft": 1}).SerializeToString())
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize("symmetric", [True, False])
def test_blocks_are_what_matmulnbits_computes(tmp_path, rng, bits, block, symmetric):
    """dequantize() is ORT's W; accuracy_level 4 is x quantized per block to int8 first."""
    w = rng.standard_normal((48, 128)).astype(np.float32)  # [N, K]
    x = rng.standard_normal((5, 128)).astype(np.float32)
    q = quantize_rtn(w, bits, block, symmetric)
    assert (q.zeros is None) == symmetric
    # at most one step (max / 2 ** (bits - 1)): the symmetric rule clips +max to the top code
    assert np.abs(q.dequantize() - w).max() <= np.abs(w).max() / 2 ** (bits - 1) * 1.0001
    np.testing.assert_allclose(_run_node(tmp_path, q, x, 0), x @ q.dequantize().T, atol=ATOL)
    int8_x = quantize_activations(x, block)
    assert 0 < np.abs(int8_x - x).max() <= np.abs(x).max() / 254 * 1.0001
    np.testing.assert_allclose(_run_node(tmp_path, q, x, 4), int8_x @ q.dequantize().T, atol=ATOL)


def test_stacked_weights_compute_each_part(tmp_path, rng):
    """q/k/v-style parts stacked into one MatMulNBits and split: each output is its part's own
    product, whether the part has zero points, per-block offsets or neither."""
    import onnxruntime as ort

    w = [rng.standard_normal((n, 64)).astype(np.float32) for n in (24, 8, 16)]
    parts = [
        quantize_rtn(w[0], 4, 32, symmetric=False),  # zero points
        replace(quantize_rtn(w[1], 4, 32, symmetric=True), offsets=rng.random((8, 2), np.float32)),
        quantize_rtn(w[2], 4, 32, symmetric=True),  # neither
    ]
    stacked = BlockQuantized.stack(parts)
    assert stacked.zeros is not None and stacked.offsets is not None
    writer = ExternalDataWriter(tmp_path / "m.onnx.data")
    g = GraphBuilder(writer, "stacked")
    g.input("x", "float32", ["T", 64])
    names = [f"model.layers.0.attn.{m}.weight" for m in ("q", "k", "v")]
    ys = QuantGraph(g, 0).stacked_matmul("x", stacked, names, [24, 8, 16], "/qkv")
    for y in ys:
        g.output(y, "float32", None)
    writer.close()
    (tmp_path / "m.onnx").write_bytes(g.model({"": 17, "com.microsoft": 1}).SerializeToString())
    x = rng.standard_normal((5, 64)).astype(np.float32)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": x})
    for y, part in zip(got, parts):
        np.testing.assert_allclose(y, x @ part.dequantize().T, atol=ATOL)
    assert BlockQuantized.stack([parts[0], quantize_rtn(w[1], 8, 32, symmetric=True)]) is None
    assert BlockQuantized.stack([parts[0], quantize_rtn(w[1], 4, 16, symmetric=True)]) is None


def test_offsets_and_the_quantized_gather(tmp_path, rng):
    w = rng.standard_normal((40, 64)).astype(np.float32)
    q = quantize_rtn(w, 4, 32, symmetric=True)
    offsets = rng.standard_normal((40, 2)).astype(np.float32)
    with_offsets = replace(q, offsets=offsets)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    got = _run_node(tmp_path, with_offsets, x, 0)
    np.testing.assert_allclose(got, x @ with_offsets.dequantize().T, atol=ATOL)
    assert np.abs(got - x @ q.dequantize().T).max() > 0.1  # the offsets were added
    ids = np.array([3, 0, 39, 3], dtype=np.int64)
    for bits in (4, 8):
        emb = quantize_rtn(w, bits, 32, symmetric=True)
        rows = _run_node(tmp_path, emb, ids, 0, gather=True)
        np.testing.assert_array_equal(rows, emb.dequantize()[ids])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_carry_over_exactly(rng, bits, ggml_type):
    """Carried-over blocks dequantize to exactly what the gguf package (and so transformers)
    reads from the file; Q8_0 cannot become int4 blocks."""
    import gguf

    qtype = gguf.GGMLQuantizationType[ggml_type]
    w = rng.standard_normal((24, 96)).astype(np.float32)
    w[:4] = np.abs(w[:4]) + 0.5  # all-positive blocks: Q4_1's minimum is > 0
    raw = gguf.quants.quantize(w, qtype)
    want = gguf.quants.dequantize(raw, qtype)
    mapped = map_blocks(raw, ggml_type, bits, 32)
    if ggml_type == "Q8_0" and bits == 4:
        assert mapped is None
        return
    assert mapped.bits == bits and mapped.block_size == 32
    np.testing.assert_allclose(mapped.dequantize(), want, rtol=1e-6, atol=1e-7)
    assert map_blocks(raw, ggml_type, bits, 64) is None  # other block sizes: requantized


@pytest.mark.parametrize("bits", [4, 8])
def test_gguf_q4_1_with_integer_zero_points_moves_each_block(rng, bits):
    """zero_point mode keeps codes and scale and rounds -m / d: every value of a block moves
    by the same amount, at most half a step where the minimum is in range (int4: values that
    are all positive or all negative clamp the zero point and move further)."""
    import gguf

    w = rng.standard_normal((16, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1)
    mapped = map_blocks(raw, "Q4_1", bits, 32, q4_1="zero_point")
    diff = (mapped.dequantize() - want).reshape(16, 2, 32)
    np.testing.assert_allclose(diff, diff[..., :1].repeat(32, -1), atol=1e-6)  # one shift
    assert 0 < np.abs(diff).max() <= 0.5 * mapped.scales.max() * 1.0001


@pytest.mark.parametrize("weights", ["int4", "int8"])
@pytest.mark.parametrize("level", [0, 4])
def test_tiny_llama_prefill_and_paged_decode(
    tiny_quant_export, tiny_llama_checkpoint, rng, weights, level
):
    """4 prompts: prefill, then 8 greedy decode steps over 3 scattered pages each."""
    out = tiny_quant_export(weights, level)
    manifest = json.loads((out / "ort_lora_manifest.json").read_text())["quantization"]
    assert manifest["weights"] == weights and manifest["accuracy_level"] == level
    assert manifest["tensors_by_method"] == {"rtn": 16}  # 14 linear, embedding, head
    nodes = onnx.load(str(out / "model.onnx")).graph.node
    ops = Counter(n.op_type for n in nodes)
    # q/k/v and gate/up stacked: 4 products a layer, and the (8-bit) head; at level 4 an int4
    # export runs them all on ort_lora's op
    ours_op = weights == "int4" and level == 4
    assert ops["QuantMatMul"] == (2 * 4 + 1 if ours_op else 0)
    assert ops["MatMulNBits"] == (0 if ours_op else 2 * 4 + 1)
    # QuantMatMul cuts its output itself where the parts are whole 64-column tiles (gate/up
    # here: 2 x 128), a Split after it where not (q/k/v: 64, 32, 32)
    cut = [n for n in nodes if any(a.name == "splits" for a in n.attribute)]
    assert len(cut) == (2 if ours_op else 0) and ops["Split"] + len(cut) == 2 * 2
    ref = reference(tiny_llama_checkpoint, out)
    runner = ModelRunner(ModelSession(out, num_pages=24))
    ours, want = [], []
    for i in range(4):
        prompt = rng.integers(0, 256, size=int(rng.integers(5, 14))).tolist()
        pages = [3 * i + 2, 3 * i, 3 * i + 1]
        logits, cache = reference_step(ref, prompt)
        plan = base_plan((prompt, 0, pages, range(len(prompt))), block_size=8)
        ours += list(runner.run(plan))
        want += list(logits)
        for past in range(len(prompt), len(prompt) + 8):
            token = int(logits[-1].argmax())
            logits, cache = reference_step(ref, [token], cache)
            ours.append(runner.run(base_plan(([token], past, pages), block_size=8))[0])
            want.append(logits[-1])
    assert_rows_match(ours, want, level)


def test_hqq_lowers_round_to_nearest_error(rng):
    """HQQ-style refinement (quant.quantize_hqq) on heavy-tailed weights: lower l_0.7 (what it
    minimizes), mean |error| and error of x @ W^T than round-to-nearest with the same scales;
    its float zero points are integer ones in 0..15 plus offsets within half a step."""
    w = (rng.standard_t(3, size=(192, 256)) * 0.02).astype(np.float32)
    x = rng.standard_normal((16, 256)).astype(np.float32)
    rtn, hqq = quantize_rtn(w, 4, 32, symmetric=False), quantize_hqq(w, 32)
    np.testing.assert_array_equal(hqq.scales, rtn.scales)
    assert hqq.zeros.max() <= 15 and np.all(np.abs(hqq.offsets) <= 0.5 * hqq.scales + 1e-9)

    def errors(q):
        e = q.dequantize() - w
        return (np.abs(e) ** 0.7).mean(), np.abs(e).mean(), np.linalg.norm(x @ e.T)

    for ours, theirs in zip(errors(hqq), errors(rtn), strict=True):
        assert ours < 0.97 * theirs  # measured 5-8 % lower on such weights


def test_tiny_llama_hqq_export_matches_its_reference(tiny_llama_checkpoint, tmp_path, rng):
    """--extra quant_method=hqq: every linear refined (manifest), the offsets carried by
    QuantMatMul; prefill and decode logits match transformers on the exported weights."""
    out = export_quantized(
        tiny_llama_checkpoint, tmp_path / "m", "int4", 4, extra={"quant_method": "hqq"}
    )
    manifest = json.loads((out / "ort_lora_manifest.json").read_text())["quantization"]
    assert manifest["tensors_by_method"] == {"hqq": 14, "rtn": 2}  # embedding and head 8-bit
    assert manifest["quant_method"] == "hqq"
    ref = reference(tiny_llama_checkpoint, out)
    runner = ModelRunner(ModelSession(out, num_pages=8))
    prompt = rng.integers(0, 256, size=11).tolist()
    logits, cache = reference_step(ref, prompt)
    rows = range(len(prompt))  # every prompt position's logits
    ours = list(runner.run(base_plan((prompt, 0, [3, 1], rows), block_size=8)))
    want = list(logits)
    token = int(logits[-1].argmax())
    want.append(reference_step(ref, [token], cache)[0][-1])
    ours.append(runner.run(base_plan(([token], len(prompt), [3, 1]), block_size=8))[0])
    assert_rows_match(ours, want, 4)


def _ggml_types(name: str) -> str:
    if "q_proj" in name or "gate_proj" in name or name == "lm_head.weight":
        return "Q4_0"
    if "embed" in name or "v_proj" in name:
        return "Q8_0"
    return "Q5_1" if "up_proj" in name else "Q4_1"


@pytest.fixture(scope="module")
def tiny_gguf(tiny_llama_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_gguf") / "tiny.gguf"
    return write_llama_gguf(tiny_llama_checkpoint, out, _ggml_types)


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_gguf_export_carries_blocks_over(tiny_gguf, tmp_path, weights):
    """Q4_0, Q4_1 and Q8_0 tensors are carried over (Q8_0 only into 8 bits: the embedding,
    and v_proj with int8), the others quantized from their dequantized values; the export
    matches transformers on the GGUF's own weights (accuracy_level 0: no int8 inputs)."""
    out = export_quantized(tiny_gguf, tmp_path / "m", weights, 0)
    q = json.loads((out / "ort_lora_manifest.json").read_text())["quantization"]
    want = {"gguf Q4_0": 5, "gguf Q4_1 (offset)": 6, "gguf Q8_0": 1, "rtn from gguf Q5_1": 2}
    want |= {"gguf Q8_0": 3} if weights == "int8" else {"rtn from gguf Q8_0": 2}
    assert q["tensors_by_method"] == want
    for method, diff in q["max_abs_diff_vs_checkpoint"].items():
        assert (diff <= 1e-6) == method.startswith("gguf"), (method, diff)
    assert verify_export(tiny_gguf, out) <= ATOL


def test_gguf_blocks_tile_in_float16(tiny_gguf, tmp_path):
    """At accuracy_level 4, QuantMatMul's tiles keep the GGUF file's float16 scales and
    minimums where every part of a product has them (Q4_0, Q4_1 blocks), float32 elsewhere,
    and read back as exactly the weights of the MatMulNBits export (float32 offsets); at
    accuracy_level 0 (float inputs) the export matches transformers on them."""
    from ort_lora.export.quant_reference import exported_weights

    tiles = export_quantized(tiny_gguf, tmp_path / "tiles", "int4", 4)
    nbits = export_quantized(tiny_gguf, tmp_path / "nbits", "int4", 0)
    model = onnx.load(str(tiles / "model.onnx"), load_external_data=False)
    types = {}
    for init in model.graph.initializer:
        kind = init.name.rsplit("/", 1)[-1]
        types.setdefault(kind, set()).add(onnx.TensorProto.DataType.Name(init.data_type))
    assert types["tile_scales"] == {"FLOAT16", "FLOAT"}
    ours, theirs = exported_weights(tiles), exported_weights(nbits)
    assert ours.keys() == theirs.keys()
    for name, q in ours.items():
        assert np.array_equal(q.dequantize(), theirs[name].dequantize()), name
    assert verify_export(tiny_gguf, tiles, accuracy_level=0) <= ATOL


def test_verify_checks_the_weights_and_reports_int8_inputs(tiny_llama_checkpoint, tmp_path, capsys):
    """--verify on an int4 export (accuracy_level 4): checked at accuracy_level 0 against
    transformers on the dequantized weights, the served level's difference printed beside."""
    args = [str(tiny_llama_checkpoint), str(tmp_path / "m"), "--weights", "int4", "--quiet"]
    rc = export_main([*args, "--block-size", "8", "--verify", "--extra", "verify_steps=4"])
    text = capsys.readouterr().out
    checked = re.search(r"dequantized weights, accuracy_level 0\| = (\S+) .*: OK", text)
    served = re.search(r"as served \(accuracy_level 4: int8 inputs\) .* = (\S+) ", text)
    assert rc == 0 and checked and served, text
    assert float(checked.group(1)) <= ATOL < float(served.group(1))


def test_verify_fails_on_a_wrong_scale(tiny_llama_checkpoint, tiny_quant_export, monkeypatch):
    """A layout bug (here: every scale of one layer 1 % off) fails the accuracy_level 0 check."""
    from ort_lora.export import quant_reference

    out = tiny_quant_export("int4", 4)
    real = quant_reference.exported_weights

    def off_by_one_percent(model_dir):
        weights = real(model_dir)
        name = "model.layers.1.mlp.down_proj.weight"
        weights[name] = replace(weights[name], scales=weights[name].scales * 1.01)
        return weights

    monkeypatch.setattr(quant_reference, "exported_weights", off_by_one_percent)
    assert verify_export(tiny_llama_checkpoint, out, accuracy_level=0, steps=2) > 10 * ATOL


BAD_INPUT = {
    "cuda": (["--weights", "int4", "--device", "cuda"], "--weights int4 needs --device cpu"),
    "float16_on_cpu": (["--weights", "float16", "--dtype", "float32"], "--dtype float16"),
    "block_not_power_of_two": (["--weights", "int8", "--block-size-q", "24"], "power of two"),
    "block_does_not_divide": (
        ["--weights", "int4", "--block-size-q", "128"],
        "does not divide the input size 64 of tensor model.embed_tokens.weight",
    ),
    "accuracy_level": (["--weights", "int4", "--extra", "accuracy_level=3"], "accuracy_level 3"),
    "q4_1_mode": (["--weights", "int4", "--extra", "gguf_q4_1=round"], "gguf_q4_1 'round'"),
    "int4_op": (["--weights", "int4", "--extra", "int4_op=Gemm"], "int4_op 'Gemm'"),
    "quant_method": (["--weights", "int4", "--extra", "quant_method=gptq"], "quant_method 'gptq'"),
    "hqq_int8": (["--weights", "int8", "--extra", "quant_method=hqq"], "with --weights int4"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_quantization_options(tiny_llama_checkpoint, tmp_path, capsys, case):
    args, message = BAD_INPUT[case]
    out = tmp_path / "out"
    rc = export_main([str(tiny_llama_checkpoint), str(out), "--quiet", *args])
    text = capsys.readouterr().err
    assert rc == 1 and message in text and "Traceback" not in text, text
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no partial directory


def test_gguf_tensor_type_that_cannot_be_mapped(tiny_llama_checkpoint, tmp_path, capsys):
    def types(name):
        return "Q8_1" if name == "model.layers.1.mlp.down_proj.weight" else "Q4_0"

    gguf_file = write_llama_gguf(tiny_llama_checkpoint, tmp_path / "bad.gguf", types)
    out = tmp_path / "out"
    with pytest.raises(ExportError, match="blk.1.ffn_down.weight .* has type Q8_1"):
        export_quantized(gguf_file, out, "int4", 4)
    rc = export_main([str(gguf_file), str(out), "--weights", "int4", "--quiet"])
    text = capsys.readouterr().err
    assert rc == 1 and "blk.1.ffn_down.weight" in text and "Q8_1" in text
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_tiny_phi3_fused_modules_quantized(tmp_path):
    """Phi-3's fused qkv_proj / gate_up_proj: the parts are row slices of one quantization."""
    ckpt = write_random_checkpoint(tmp_path / "ckpt", tiny_config("phi3"), seed=7)
    out = export_quantized(ckpt, tmp_path / "m", "int4", 0)
    assert verify_export(ckpt, out) <= ATOL


@pytest.mark.slow
def test_smollm2_gguf_int4_carries_every_block_over(smollm2_int4_export):
    q = json.loads((smollm2_int4_export / "ort_lora_manifest.json").read_text())["quantization"]
    assert q["tensors_by_method"] == {"gguf Q4_1 (offset)": 210, "gguf Q8_0": 1}
    assert q["max_abs_diff_vs_checkpoint"] == {"gguf Q4_1 (offset)": 0.0, "gguf Q8_0": 0.0}
    assert q["accuracy_level"] == 4 and q["block_size"] == 32


# |served logits - transformers| on SmolLM2 int4's chat prompt: int8 inputs per block move every
# logit (measured: at most 1.49 with ONNX Runtime's MatMulNBits, 1.38 with QuantMatMul)
INT8_INPUT_LOGIT_TOL = 2.0


@pytest.mark.slow
def test_smollm2_gguf_int4_greedy_matches_transformers(smollm2_gguf, smollm2_int4_export):
    """With float inputs (accuracy_level 0, --verify's copy of the graph): the same 16 greedy
    tokens of the chat prompt as transformers on the GGUF's own dequantized weights. As served
    (int8 inputs, accuracy_level 4), fed the same tokens: every step's logits within
    INT8_INPUT_LOGIT_TOL of transformers', and a top token of ours that differs only where
    transformers' own top two are closer than the int8 inputs move logits (2x that step's
    difference): the first token, whose top two (504, 60) are 0.08 apart, is 60 with
    QuantMatMul's summation order and was 504 with MatMulNBits'."""
    import torch
    from test_export_smollm2 import NEW_TOKENS, PROMPT, _greedy_ours
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = dict(pretrained_model_name_or_path=str(smollm2_gguf.parent))
    where["gguf_file"] = smollm2_gguf.name
    ids = AutoTokenizer.from_pretrained(**where).apply_chat_template(
        PROMPT, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32).eval()
    want, want_logits, (logits, cache) = [], [], reference_step(model, ids)
    while len(want) < NEW_TOKENS:  # argmax past EOS too, as ours does
        want_logits.append(np.asarray(logits[-1], np.float64))
        want.append(int(want_logits[-1].argmax()))
        logits, cache = reference_step(model, [want[-1]], cache)
    with at_accuracy_level(smollm2_int4_export, 0) as float_inputs:
        assert _greedy_ours(float_inputs, ids) == want
    served = _forced_logits(smollm2_int4_export, ids, want[:-1])
    for step, (ours, theirs, token) in enumerate(zip(served, want_logits, want)):
        diff = float(np.abs(ours - theirs).max())
        assert diff <= INT8_INPUT_LOGIT_TOL, (step, diff)
        top = int(ours.argmax())
        assert top == token or theirs[token] - theirs[top] <= 2 * diff, (step, top, token)


def _forced_logits(export_dir, prompt_ids: list[int], tokens: list[int]) -> list[np.ndarray]:
    """Logits of the prompt's last token, then of each of `tokens` fed one a step."""
    runner = ModelRunner(ModelSession(export_dir, num_pages=8))
    bs, pages = runner.block_size, [5, 2, 7, 0]
    out = [runner.run(base_plan((prompt_ids, 0, pages), block_size=bs))[0]]
    for past, token in enumerate(tokens, start=len(prompt_ids)):
        out.append(runner.run(base_plan(([token], past, pages), block_size=bs))[0])
    return out
