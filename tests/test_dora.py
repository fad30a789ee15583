"""DoRA adapters (PEFT use_dora) in their host form and pool rows, against PEFT's own DoRA.

Oracle: PEFT's DoraLinearLayer on the same base weights: its scale m / ||W + s B A|| (PEFT's
get_weight_norm, detached) and the module output lin(x) - base(x). Ours: the D row the registry
writes into the pool (1 + D = the scale) and (1 + D) (W x + s B A x) - W x. Base weights come
from the PEFT model itself (TorchBase) or, end to end, from an export's model.onnx
(ExportedWeights: memory-mapped initializers; MatMulNBits weights dequantized, checked against
ONNX Runtime running the node). Refusals: DoRA where the export cannot serve it, by name.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from ort_lora.adapter_rows import served
from ort_lora.adapters import AdapterError, AdapterRegistry
from ort_lora.adapters.base_weights import ExportedWeights
from ort_lora.adapters.host import load_adapter
from ort_lora.contract import LORA_MODULES, lora_input_name
from ort_lora.lora_request import LoRARequest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from peft_cases import pool_rows, served_lora  # noqa: E402
from test_adapters import (  # noqa: E402
    BLOCK,
    HIDDEN,
    INTER,
    KV_HEADS,
    LAYERS,
    NUM_PAGES,
    manifest,
    tiny_config,
)

DORA_ADAPTERS = {
    "dora_qv": dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 2}
    ),
    "dora_all_rs": dict(
        r=8,
        lora_alpha=16,
        use_rslora=True,
        target_modules=list(LORA_MODULES),
        alpha_pattern={"down_proj": 4},
        layers_to_transform=[1],
    ),  # fmt: skip
}


def make_dora_adapter(path, seed, config=None, **lora_kwargs):
    """A PEFT DoRA adapter with random A, B and a magnitude moved off its initial norm (else
    the scale is exactly 1)."""
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(config or tiny_config())
    cfg = peft.LoraConfig(init_lora_weights=False, use_dora=True, **lora_kwargs)
    model = peft.get_peft_model(base, cfg)
    perturb_magnitudes(model)
    model.save_pretrained(path)
    return model


def perturb_magnitudes(model, spread: float = 0.3) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + spread * torch.randn_like(p))


@pytest.fixture(scope="module")
def dora_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("dora_adapters")
    models = {
        name: make_dora_adapter(root / name, 40 + seed, **kw)
        for seed, (name, kw) in enumerate(DORA_ADAPTERS.items())
    }
    return root, models


def linear(model, module: str, layer: int):
    return getattr(getattr(model.base_model.model.model.layers[layer], BLOCK[module]), module)


class TorchBase:
    """BaseWeights of a PEFT model: its base layers' weights."""

    def __init__(self, model, fused=None):
        self.model, self.fused = model, fused or {}

    def rows(self, layer: int, module: str, start: int, stop: int) -> np.ndarray:
        w = linear(self.model, module, layer).base_layer.weight.detach().double().numpy()
        return w[start:stop]


def peft_scale(model, module: str, layer: int) -> np.ndarray:
    """PEFT's own m / ||W + s B A|| (DoraLinearLayer.get_weight_norm, as its forward does)."""
    lin = linear(model, module, layer)
    dora = lin.lora_magnitude_vector["default"]
    with torch.no_grad():
        lora_weight = dora.get_lora_weight(lin.lora_A["default"], lin.lora_B["default"])
        norm = dora.get_weight_norm(lin.base_layer.weight, lora_weight, lin.scaling["default"])
        return (dora.weight / norm).numpy()


def placed(reg, name, aid, adapter_dtype, rng):
    """(pool, step inputs) with the adapter written into random free pages of slot 0."""
    pool = rng.standard_normal((LAYERS, 2, NUM_PAGES, 8, KV_HEADS, 16)).astype(np.float32)
    pages = tuple(int(p) for p in rng.permutation(NUM_PAGES)[: reg.num_pages_needed(aid)])
    reg.write_to_pool(aid, pages, pool)
    return pool, reg.lora_step_inputs([(0, aid, pages)], NUM_PAGES)


@pytest.mark.parametrize("adapter_dtype", [None, "bfloat16", "float16", "int8"])
@pytest.mark.parametrize("name", list(DORA_ADAPTERS))
def test_pool_rows_give_peft_scale_and_output(dora_adapters, name, adapter_dtype, rng):
    """For every module and layer: 1 + D read from the pool at the step's dora offset is PEFT's
    scale, and (1 + D) (W x + s B A x) - W x is PEFT's DoRA delta lin(x) - base(x); layers and
    modules without LoRA have no scale. bfloat16 / float16 / int8 rows: PEFT with A and B rounded as
    served (the norm is the served rows'), D within its own rounding (relative to D)."""
    root, models = dora_adapters
    model = served_lora(models[name], adapter_dtype)
    man = manifest(adapter_dtype=adapter_dtype)
    reg = AdapterRegistry(man, base_weights=TorchBase(model))
    reg.register(LoRARequest(name, 1, str(root / name)))
    pool, inputs = placed(reg, name, 1, adapter_dtype, rng)
    # D's relative rounding: bfloat16's 8 bits, float16's 11, or int8's half step of the peak
    bits = {None: 0, "bfloat16": 2**-8, "float16": 2**-11, "int8": 0.5 / 127}[adapter_dtype]
    checked = 0
    for module in LORA_MODULES:
        offset = int(inputs[lora_input_name(module, "dora_offsets")][0])
        targeted = [hasattr(linear(model, module, la), "lora_magnitude_vector") for la in (0, 1)]
        assert (offset >= 0) == any(targeted)
        for layer in range(LAYERS):
            rank = inputs[lora_input_name(module, "ranks")][layer, 0]
            if rank == 0:
                continue
            out = man.lora_targets[module]["out"]
            d = pool_rows(pool[layer].reshape(-1), [offset], out, adapter_dtype)[0]
            want = peft_scale(model, module, layer)
            np.testing.assert_allclose(1 + d, want, atol=bits * np.abs(want - 1).max() + 1e-6)
            checked += 1
            x = rng.standard_normal((5, man.lora_targets[module]["in"])).astype(np.float32)
            _check_output(reg, model, module, layer, x, 1 + d, bits, adapter_dtype)
    assert checked >= 2


def _check_output(reg, model, module, layer, x, scale, bits, row_type=None):
    """(1 + D) (W x + s B A x) - W x with the served rows (row_type) is PEFT's lin(x) -
    base(x); bits: D's relative rounding."""
    lin = linear(model, module, layer)
    w = reg.get(1).modules[module]
    a, bt = served(w.layer_a(layer), row_type), served(w.layer_bt(layer), row_type)
    base = lin.base_layer.weight.detach().numpy()  # [out, in]
    merged = x @ base.T + w.scales[layer] * (x @ a.T) @ bt  # [T, out]
    with torch.no_grad():
        xt = torch.from_numpy(x)
        want = (lin(xt) - lin.base_layer(xt)).numpy()
    atol = 2e-5 + bits * np.abs(scale - 1).max() * np.abs(merged).max()
    np.testing.assert_allclose(scale * merged - x @ base.T, want, atol=atol, rtol=0)


def test_layers_without_lora_have_zero_rows(dora_adapters):
    """layers_to_transform=[1]: layer 0 has no LoRA, so no scale (D = 0, never read: rank 0)."""
    root, models = dora_adapters
    host = load_adapter("dora_all_rs", root / "dora_all_rs", manifest())
    from ort_lora.adapters.dora import dora_scale_rows

    dora_scale_rows(host, TorchBase(models["dora_all_rs"]))
    for module, w in host.modules.items():
        assert w.magnitude is None and w.dora.shape == (
            LAYERS,
            manifest().lora_targets[module]["out"],
        )
        assert not w.dora[0].any() and w.dora[1].any(), module


def test_dora_rows_take_their_own_place_in_the_pages(dora_adapters, rng):
    """A, B^T and D rows of every module lie inside the adapter's pages, none overlapping,
    none straddling a page half; D adds one row per module to the pages needed."""
    root, models = dora_adapters
    reg = AdapterRegistry(manifest(), base_weights=TorchBase(models["dora_qv"]))
    reg.register(LoRARequest("dora_qv", 1, str(root / "dora_qv")))
    pages = tuple(int(p) for p in rng.permutation(NUM_PAGES)[: reg.num_pages_needed(1)])
    inputs = reg.lora_step_inputs([(0, 1, pages)], NUM_PAGES)
    page_elems = 8 * KV_HEADS * 16
    used = np.zeros(2 * NUM_PAGES * page_elems, bool)
    for module, dims in manifest().lora_targets.items():
        rows = [(o, dims["in"]) for o in inputs[lora_input_name(module, "a_offsets")][0]]
        rows += [(o, dims["out"]) for o in inputs[lora_input_name(module, "b_offsets")][0]]
        d = int(inputs[lora_input_name(module, "dora_offsets")][0])
        rows += [(d, dims["out"])] if d >= 0 else []
        if module not in ("q_proj", "v_proj"):
            assert d == -1
            continue
        for start, n in rows:
            half = start // page_elems
            assert (start + n - 1) // page_elems == half, "a row straddles a page half"
            assert half % NUM_PAGES in pages, "a row outside the adapter's pages"
            assert not used[start : start + n].any(), "rows overlap"
            used[start : start + n] = True


# --- the export's own base weights ------------------------------------------------------------


def test_exported_weights_are_the_checkpoint_rows(tiny_llama_export, tiny_llama_checkpoint):
    """Rows read back from the export's external data (memory-mapped) are the checkpoint's."""
    from safetensors.numpy import load_file

    ckpt = load_file(str(tiny_llama_checkpoint / "model.safetensors"))
    base = ExportedWeights(tiny_llama_export)
    for layer, module, block in ((0, "q_proj", "self_attn"), (1, "down_proj", "mlp")):
        w = ckpt[f"model.layers.{layer}.{block}.{module}.weight"]  # [out, in]
        np.testing.assert_array_equal(base.rows(layer, module, 3, 11), w[3:11])
        np.testing.assert_array_equal(base.rows(layer, module, 0, len(w)), w)


def nbits_model(rng, n=40, k=80, bits=4, block=32, zero_points="packed", offsets=False):
    """A graph y = MatMulNBits(x) [+ block sums of x @ offsets^T] -> LoraSGMV, its weights
    written as an export writes them (external data), and the W [n, k] its node computes
    (ONNX Runtime on the identity)."""
    from onnx import TensorProto, helper, numpy_helper

    k_blocks = -(-k // block)
    codes = rng.integers(0, 256, (n, k_blocks, block * bits // 8), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, n * k_blocks).astype(np.float32)
    inits = {"B": codes, "scales": scales}
    if zero_points == "packed":
        per_row = -(-k_blocks * bits // 8)
        inits["zero_points"] = rng.integers(0, 256, n * per_row, dtype=np.uint8)
    elif zero_points == "float":
        inits["zero_points"] = rng.uniform(0, 2**bits - 1, n * k_blocks).astype(np.float32)
    attrs = dict(K=k, N=n, bits=bits, block_size=block, accuracy_level=0)
    nodes = [helper.make_node("MatMulNBits", ["x", *inits], ["y"], domain="com.microsoft",
                              **attrs)]  # fmt: skip
    y = "y"
    if offsets:
        inits["offsets_T"] = rng.uniform(-0.5, 0.5, (k_blocks, n)).astype(np.float32)
        inits["shape"] = np.array([-1, k_blocks, block], np.int64)
        inits["axes"] = np.array([2], np.int64)
        nodes += [
            helper.make_node("Reshape", ["x", "shape"], ["blocks"]),
            helper.make_node("ReduceSum", ["blocks", "axes"], ["sums"], keepdims=0),
            helper.make_node("MatMul", ["sums", "offsets_T"], ["extra"]),
            helper.make_node("Add", ["y", "extra"], ["y2"]),
        ]
        y = "y2"
    tensors = [numpy_helper.from_array(v, name) for name, v in inits.items()]
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])
    y_info = helper.make_tensor_value_info(y, TensorProto.FLOAT, [None, n])
    graph = helper.make_graph(nodes, "nbits", [x_info], [y_info], initializer=tensors)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
    return model, y


def ort_weight(model, y: str, k: int) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run([y], {"x": np.eye(k, dtype=np.float32)})[0].T  # [n, k]


def with_lora_node(model, y: str, tmp_path, module="q_proj", layer=0):
    """model + a LoraSGMV node of (layer, module) on y, saved as model.onnx + external data."""
    import onnx
    from onnx import helper

    from ort_lora.contract import MODEL_NAME, OPS_DOMAIN

    inputs = [y, "x", "k", "v", "s", "sl", lora_input_name(module, "a_offsets")]
    model.graph.node.append(helper.make_node("LoraSGMV", inputs, ["lora_out"], domain=OPS_DOMAIN,
                                             layer=layer))  # fmt: skip
    onnx.save(model, str(tmp_path / MODEL_NAME), save_as_external_data=True,
              location="model.onnx.data", size_threshold=0)  # fmt: skip
    return ExportedWeights(tmp_path)


@pytest.mark.parametrize(
    "bits, block, zero_points, offsets",
    [(4, 32, "packed", False), (4, 16, None, False), (8, 32, "packed", False),
     (4, 32, "float", False), (4, 32, "packed", True), (8, 64, None, True)],
)  # fmt: skip
def test_matmulnbits_weights_dequantized_as_onnxruntime_runs_them(
    tmp_path, rng, bits, block, zero_points, offsets
):
    """DoRA on an int4 / int8 export: W read back is what ORT's MatMulNBits multiplies by
    (codes, scales, zero points packed / float / default, K = 80 not a multiple of the block,
    the Q4_1 offset branch)."""
    k = 128 if offsets else 80  # the offset branch sums whole blocks
    model, y = nbits_model(rng, k=k, bits=bits, block=block, zero_points=zero_points,
                           offsets=offsets)  # fmt: skip
    want = ort_weight(model, y, k)
    base = with_lora_node(model, y, tmp_path)
    np.testing.assert_allclose(base.rows(0, "q_proj", 0, 40), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(base.rows(0, "q_proj", 7, 19), want[7:19], rtol=1e-5, atol=1e-5)


def test_unreadable_base_weights_are_refused_by_name(tmp_path, rng):
    """A base projection the reader cannot invert (here DequantizeLinear -> MatMul; likewise a
    bias added before LoraSGMV) is an AdapterError naming the module, layer and producer."""
    from onnx import TensorProto, helper, numpy_helper

    q = numpy_helper.from_array(rng.integers(-8, 8, (16, 8), dtype=np.int8), "wq")
    s = numpy_helper.from_array(np.float32(0.1), "ws")
    nodes = [helper.make_node("DequantizeLinear", ["wq", "ws"], ["w"]),
             helper.make_node("MatMul", ["x", "w"], ["y"])]  # fmt: skip
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 16])
    y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 8])
    graph = helper.make_graph(nodes, "dq", [x_info], [y_info], initializer=[q, s])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    base = with_lora_node(model, "y", tmp_path, module="v_proj", layer=0)
    match = r"base weight of v_proj in layer 0 cannot be read back.*MatMul.*float \[in, out\]"
    with pytest.raises(AdapterError, match=match):
        base.rows(0, "v_proj", 0, 8)
    with pytest.raises(AdapterError, match="no LoraSGMV node for q_proj in layer 0"):
        base.rows(0, "q_proj", 0, 8)


# --- refusals and errors ------------------------------------------------------------------------


def test_dora_on_an_export_from_before_dora_is_refused(dora_adapters):
    root, models = dora_adapters
    old = dataclasses.replace(manifest(), lora_features=[])
    reg = AdapterRegistry(old, base_weights=TorchBase(models["dora_qv"]))
    with pytest.raises(AdapterError, match=r"'dora_qv' is a DoRA adapter.*predates DoRA support"):
        reg.register(LoRARequest("dora_qv", 1, str(root / "dora_qv")))
    assert len(reg) == 0


def test_dora_without_base_weights_is_refused(dora_adapters):
    root, _ = dora_adapters
    reg = AdapterRegistry(manifest())  # a hand-made manifest: no model directory
    with pytest.raises(AdapterError, match=r"DoRA adapter \(use_dora\): its scale needs the base"):
        reg.register(LoRARequest("dora_qv", 1, str(root / "dora_qv")))


def test_dora_on_a_quantized_module_it_cannot_read_is_refused(dora_adapters, tmp_path, rng):
    """The registry's own reader over a graph whose q_proj comes from an unreadable node."""
    root, _ = dora_adapters

    class Unreadable:
        def rows(self, layer, module, start, stop):
            raise AdapterError(f"the base weight of {module} in layer {layer} cannot be read back")

    reg = AdapterRegistry(manifest(), base_weights=Unreadable())
    match = r"DoRA adapter 'dora_qv': the base weight of q_proj in layer 0 cannot be read back"
    with pytest.raises(AdapterError, match=match):
        reg.register(LoRARequest("dora_qv", 1, str(root / "dora_qv")))


def edited(src, dst, config=None, tensors=None):
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps(cfg | config))
    if tensors:
        t = load_file(dst / "adapter_model.safetensors")
        tensors(t)
        save_file(t, dst / "adapter_model.safetensors")
    return dst


MAGNITUDE = "base_model.model.model.layers.1.self_attn.q_proj.lora_magnitude_vector"


@pytest.mark.parametrize(
    "config, tensors, message",
    [
        ({"use_dora": False}, None, r"q_proj\.lora_magnitude_vector' is a DoRA magnitude, but"),
        (None, lambda t: t.pop(MAGNITUDE), r"q_proj\.lora_A\.weight' has no matching lora_magn"),
        (None, lambda t: t.update({MAGNITUDE: np.ones(3, np.float32)}), r"shape \[3\]; expected"),
        (None, lambda t: t[MAGNITUDE].__setitem__(5, np.nan), r"magnitude_vector' holds 1 NaN"),
        (None, lambda t: t[MAGNITUDE].__setitem__(0, np.inf), r"magnitude_vector' holds 1 NaN"),
        ({"use_dora": "yes"}, None, r"use_dora must be a bool, got 'yes'"),
    ],
)
def test_bad_dora_adapters_are_refused_by_name(dora_adapters, tmp_path, config, tensors, message):
    root, models = dora_adapters
    bad = edited(root / "dora_qv", tmp_path / "bad", config, tensors)
    reg = AdapterRegistry(manifest(), base_weights=TorchBase(models["dora_qv"]))
    with pytest.raises(AdapterError, match=message):
        reg.register(LoRARequest("bad", 1, str(bad)))
    assert len(reg) == 0


def test_zero_weight_norm_is_refused(dora_adapters):
    """A base row and delta that are both zero: the scale m / 0 is refused, not served."""
    root, models = dora_adapters

    class ZeroRows(TorchBase):
        def rows(self, layer, module, start, stop):
            w = super().rows(layer, module, start, stop)
            return np.zeros_like(w) if module == "v_proj" else w

    host = load_adapter("dora_qv", root / "dora_qv", manifest())
    for w in host.modules.values():
        w.a[:] = 0  # no delta either
    from ort_lora.adapters.dora import dora_scale_rows

    with pytest.raises(AdapterError, match=r"v_proj of layer 0, output row 0: magnitude .* / "
                       r"weight norm 0.0 is not finite"):  # fmt: skip
        dora_scale_rows(host, ZeroRows(models["dora_qv"]))


# --- fused modules (Phi-3) ------------------------------------------------------------------------

FUSED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def test_fused_dora_parts_side_by_side_are_peft(tmp_path, rng):
    """DoRA on Phi-3's qkv_proj / gate_up_proj: each part's scale rows and output, side by
    side, are PEFT's fused DoRA module (the magnitude and the norms split by row blocks)."""
    torch.manual_seed(9)
    config = transformers.Phi3Config(
        hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=KV_HEADS, vocab_size=100, pad_token_id=0,
    )  # fmt: skip
    lora = peft.LoraConfig(init_lora_weights=False, use_dora=True, r=4, lora_alpha=8,
                           target_modules=["qkv_proj", "gate_up_proj"])  # fmt: skip
    model = peft.get_peft_model(transformers.Phi3ForCausalLM(config), lora)
    perturb_magnitudes(model)
    model.save_pretrained(tmp_path / "fused")
    man = dataclasses.replace(manifest(), architecture="Phi3ForCausalLM", fused_modules=FUSED)

    class FusedBase:
        def rows(self, layer, module, start, stop):
            fused = next(f for f, parts in FUSED.items() if module in parts)
            block = "self_attn" if fused == "qkv_proj" else "mlp"
            lin = getattr(getattr(model.base_model.model.model.layers[layer], block), fused)
            parts = FUSED[fused]
            first = sum(man.lora_targets[p]["out"] for p in parts[: parts.index(module)])
            w = lin.base_layer.weight.detach().double().numpy()
            return w[first + start : first + stop]

    host = load_adapter("fused", tmp_path / "fused", man)
    from ort_lora.adapters.dora import dora_scale_rows

    dora_scale_rows(host, FusedBase())
    x = rng.standard_normal((5, HIDDEN)).astype(np.float32)
    for layer in range(LAYERS):
        for fused, block in (("qkv_proj", "self_attn"), ("gate_up_proj", "mlp")):
            lin = getattr(getattr(model.base_model.model.model.layers[layer], block), fused)
            base = lin.base_layer.weight.detach().numpy()
            ours = np.concatenate([_part_out(host.modules[p], layer, x) for p in FUSED[fused]], 1)
            with torch.no_grad():
                xt = torch.from_numpy(x)
                want = (lin(xt) - lin.base_layer(xt)).numpy()
            starts = np.cumsum([0] + [man.lora_targets[p]["out"] for p in FUSED[fused]])
            wx = x @ base.T
            scaled = ours + np.concatenate(
                [(host.modules[p].dora[layer] + 1) * wx[:, s:e] for p, s, e in
                 zip(FUSED[fused], starts[:-1], starts[1:])], 1)  # fmt: skip
            np.testing.assert_allclose(scaled - wx, want, atol=2e-5, rtol=0)


def _part_out(w, layer, x):
    """A part's (1 + D) * s B A x (its W x share is added by the caller)."""
    return (1 + w.dora[layer]) * (w.scales[layer] * (x @ w.layer_a(layer).T) @ w.layer_bt(layer))


# --- quantized exports (--weights int4 / int8, GGUF blocks) -----------------------------------


def _ggml_types(name: str) -> str:
    """Q4_1 (its float minimum as a per-block offset) on most linears, Q4_0 on q_proj."""
    return "Q4_0" if "q_proj" in name else "Q8_0" if "embed" in name else "Q4_1"


@pytest.mark.parametrize(
    "source, weights, level",
    [("hf", "int4", 0), ("hf", "int4", 4), ("hf", "int8", 0), ("gguf", "int4", 0),
     ("gguf", "int4", 4)],
)  # fmt: skip
def test_quantized_exports_read_back_as_their_dequantized_blocks(
    tiny_llama_checkpoint, tmp_path, source, weights, level
):
    """The rows DoRA's norm reads from an int4 / int8 export (round-to-nearest with zero
    points; GGUF Q4_0 / Q4_1 blocks with per-block offsets; 4-bit blocks at accuracy_level 4
    in QuantMatMul's tiles) are the export's own dequantized weights, as the export's
    transformers reference reads them (quant_reference.py)."""
    import onnx
    from quant_cases import export_quantized

    from ort_lora.export.quant_reference import exported_weights
    from ort_lora.export.tiny_gguf import write_llama_gguf

    checkpoint = tiny_llama_checkpoint
    if source == "gguf":
        checkpoint = write_llama_gguf(tiny_llama_checkpoint, tmp_path / "t.gguf", _ggml_types)
    out = export_quantized(checkpoint, tmp_path / "m", weights, level)
    ops = {n.op_type for n in onnx.load(str(out / "model.onnx")).graph.node}
    assert ("QuantMatMul" in ops) == (weights == "int4" and level == 4)
    blocks = exported_weights(out)
    base = ExportedWeights(out)
    offsets = 0
    for layer in range(2):
        for module in LORA_MODULES:
            q = blocks[f"model.layers.{layer}.{BLOCK[module]}.{module}.weight"]
            offsets += q.offsets is not None
            want = q.dequantize()  # [out, in]
            np.testing.assert_allclose(base.rows(layer, module, 0, len(want)), want, atol=1e-6)
            part = slice(len(want) // 3, len(want) - 5)
            np.testing.assert_allclose(
                base.rows(layer, module, part.start, part.stop), want[part], atol=1e-6
            )
    assert (offsets > 0) == (source == "gguf"), "GGUF Q4_1 blocks carry a per-block offset"


def test_a_reload_after_host_eviction_reuses_the_dora_rows_unless_the_files_changed(
    dora_adapters, tmp_path
):
    """The host cache holds one adapter: the other's reload reads its files again but keeps
    the DoRA rows computed at registration; after its files change they are recomputed."""
    root, models = dora_adapters
    calls = []

    class Counting(TorchBase):
        def rows(self, layer, module, start, stop):
            calls.append((layer, module))
            return super().rows(layer, module, start, stop)

    src = next(iter(models))
    path = shutil.copytree(root / src, tmp_path / "copy")
    reg = AdapterRegistry(manifest(), max_cpu_loras=1, base_weights=Counting(models[src]))
    reg.register(LoRARequest("d1", 1, str(path)))
    reg.register(LoRARequest("plain", 2, str(root / src)))  # evicts d1 from the host cache
    first = {m: w.dora.copy() for m, w in reg.get(1).modules.items() if w.dora is not None}
    assert calls and reg.cached_ids() == [1]
    computed = len(calls)
    reg.get(2), reg.get(1)  # d1 evicted and reloaded: its rows are kept
    assert len(calls) == computed and reg.stats["host_misses"] == 3
    for m, d in first.items():
        np.testing.assert_array_equal(reg.get(1).modules[m].dora, d)
    config = path / "adapter_config.json"
    config.write_text(config.read_text() + " ")  # the files changed: computed again
    reg.get(2), reg.get(1)
    assert len(calls) > computed
