"""Adapter registry vs PEFT: scaling, patterns and pool layout, refusals, host cache.

Oracle: PEFT's own LoRA module output (peft layer(x) - base layer(x)) for every module and layer;
ours is a plain numpy forward whose A / B^T rows are gathered from a random pool at the offsets
the registry hands to the graph.
"""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from peft_cases import pool_rows, served_lora

from ort_lora.adapter_rows import row_elems
from ort_lora.adapters import AdapterError, AdapterNotFoundError, AdapterPathError, AdapterRegistry
from ort_lora.contract import LORA_MODULES, ModelManifest, lora_input_name
from ort_lora.lora_request import LoRARequest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 2, 4, 2, 16
NUM_PAGES = 48
BLOCK = {m: "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
         for m in LORA_MODULES}  # fmt: skip

ADAPTERS = {
    "qv4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all8": dict(
        r=8,
        lora_alpha=16,
        target_modules="all-linear",
        rank_pattern={"q_proj": 2, "layers.1.mlp.down_proj": 6},
        alpha_pattern={"v_proj": 32, "model.layers.0.self_attn.o_proj": 3},
    ),
    "mlp16rs": dict(
        r=16, lora_alpha=16, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]
    ),
    "layer1": dict(
        r=4, lora_alpha=4, target_modules=["q_proj", "k_proj", "o_proj"], layers_to_transform=[1]
    ),  # fmt: skip
}


def tiny_config(hidden=HIDDEN, layers=LAYERS):
    return transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=INTER, num_hidden_layers=layers,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=hidden // HEADS,
        vocab_size=100,
    )  # fmt: skip


def manifest(targets=LORA_MODULES, layers=LAYERS, adapter_dtype=None):
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    dims = {"q_proj": (HIDDEN, q), "k_proj": (HIDDEN, kv), "v_proj": (HIDDEN, kv),
            "o_proj": (q, HIDDEN), "gate_proj": (HIDDEN, INTER), "up_proj": (HIDDEN, INTER),
            "down_proj": (INTER, HIDDEN)}  # fmt: skip
    return ModelManifest(
        architecture="LlamaForCausalLM", model_type="llama", num_layers=layers,
        hidden_size=HIDDEN, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
        intermediate_size=INTER, vocab_size=100, max_position_embeddings=128, block_size=8,
        dtype="float32", device="cpu", eos_token_ids=[2],
        lora_targets={m: {"in": dims[m][0], "out": dims[m][1]} for m in targets},
        adapter_dtype=adapter_dtype,
    )  # fmt: skip


def make_adapter(path, seed, dtype=torch.float32, config=None, **lora_kwargs):
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(config or tiny_config())
    cfg = peft.LoraConfig(init_lora_weights=False, **lora_kwargs)
    model = peft.get_peft_model(base, cfg).to(dtype)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    models = {
        name: make_adapter(root / name, seed, **kw)
        for seed, (name, kw) in enumerate(ADAPTERS.items())
    }
    return root, models


def peft_delta(model, module, layer, x):
    """PEFT's LoRA contribution of one linear: lora layer(x) - base layer(x)."""
    lin = getattr(getattr(model.base_model.model.model.layers[layer], BLOCK[module]), module)
    base = getattr(lin, "base_layer", lin)
    with torch.no_grad():
        xt = torch.from_numpy(x)
        return (lin(xt) - base(xt)).numpy()


def pool_delta(pool, inputs, slot, module, layer, x, row_type=None):
    """Numpy forward of one slot's LoRA, rows gathered from the pool at the step offsets (rows
    of row_type, read as LoraSGMV reads them)."""
    flat = pool[layer].reshape(-1)  # key_cache.{l} then value_cache.{l}
    r = inputs[lora_input_name(module, "ranks")][layer, slot]
    s = inputs[lora_input_name(module, "scales")][layer, slot]
    a_off = inputs[lora_input_name(module, "a_offsets")][slot, :r]
    b_off = inputs[lora_input_name(module, "b_offsets")][slot, :r]
    n_in, n_out = x.shape[1], manifest().lora_targets[module]["out"]
    a = pool_rows(flat, a_off, n_in, row_type)
    bt = pool_rows(flat, b_off, n_out, row_type)
    return s * (x @ a.T) @ bt  # [T, out]


@pytest.mark.parametrize("adapter_dtype", [None, "bfloat16", "float16", "int8"])
def test_matches_peft_for_every_module_and_layer(adapters, adapter_dtype):
    """Rows written to the pool, read back at the step's offsets, give PEFT's LoRA delta
    (16-bit / int8 rows: PEFT with the weights rounded as served, float32 arithmetic)."""
    root, models = adapters
    models = {name: served_lora(m, adapter_dtype) for name, m in models.items()}
    man = manifest(adapter_dtype=adapter_dtype)
    reg = AdapterRegistry(man, max_cpu_loras=8, adapter_root=root)
    rng = np.random.default_rng(0)
    pool = rng.standard_normal((LAYERS, 2, NUM_PAGES, 8, KV_HEADS, HEAD_DIM)).astype(np.float32)
    free = list(rng.permutation(NUM_PAGES))
    slots = []
    for slot, name in enumerate(models):
        reg.register(LoRARequest(name, slot + 1, str(root / name)))
        pages = tuple(int(free.pop()) for _ in range(reg.num_pages_needed(name)))
        reg.write_to_pool(name, pages, pool)
        slots.append((slot, slot + 1, pages))
    inputs = reg.lora_step_inputs(slots, NUM_PAGES)
    for slot, name in enumerate(models):
        for module, dims in man.lora_targets.items():
            for layer in range(LAYERS):
                x = rng.standard_normal((5, dims["in"])).astype(np.float32)
                want = peft_delta(models[name], module, layer, x)
                got = pool_delta(pool, inputs, slot, module, layer, x, adapter_dtype)
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4,
                                           err_msg=f"{name} {module} layer {layer}")  # fmt: skip


def test_ranks_and_scales_follow_peft_patterns(adapters):
    root, models = adapters
    reg = AdapterRegistry(manifest())
    reg.register(LoRARequest("all8", 1, str(root / "all8")))
    mods = reg.get("all8").modules
    for module, weights in mods.items():
        for layer in range(LAYERS):
            lin = getattr(getattr(models["all8"].base_model.model.model.layers[layer],
                                  BLOCK[module]), module)  # fmt: skip
            assert weights.ranks[layer] == lin.r["default"], (module, layer)
            assert weights.scales[layer] == pytest.approx(lin.scaling["default"]), (module, layer)
    # rank_pattern and alpha_pattern really differ somewhere, so the check above has teeth
    assert mods["q_proj"].ranks.tolist() == [2, 2]
    assert mods["down_proj"].ranks.tolist() == [8, 6]


def test_step_inputs_shapes_and_defaults(adapters):
    root, _ = adapters
    man = manifest()
    reg = AdapterRegistry(man)
    reg.register(LoRARequest("qv4", 7, str(root / "qv4")))
    empty = reg.lora_step_inputs([], NUM_PAGES)
    for m in man.lora_targets:
        assert empty[lora_input_name(m, "a_offsets")].shape == (1, 1)
        assert empty[lora_input_name(m, "ranks")].shape == (LAYERS, 1)
        assert not empty[lora_input_name(m, "ranks")].any()
    pages = tuple(range(reg.num_pages_needed(7)))
    step = reg.lora_step_inputs([(2, 7, pages)], NUM_PAGES)
    assert step[lora_input_name("q_proj", "a_offsets")].shape == (3, 4)
    assert step[lora_input_name("q_proj", "ranks")].tolist() == [[0, 0, 4], [0, 0, 4]]
    assert step[lora_input_name("k_proj", "ranks")].tolist() == [[0, 0, 0], [0, 0, 0]]
    assert step[lora_input_name("k_proj", "a_offsets")].shape == (3, 1)
    assert step[lora_input_name("q_proj", "a_offsets")].dtype == np.int64
    assert step[lora_input_name("q_proj", "scales")].dtype == np.float32
    assert reg.lora_step_inputs([(2, 7, pages)], NUM_PAGES) is step  # steady-state decode
    by_name = reg.lora_step_inputs([(2, "qv4", pages)], NUM_PAGES)
    assert all(np.array_equal(by_name[k], v) for k, v in step.items())


@pytest.mark.parametrize("adapter_dtype", [None, "bfloat16", "float16", "int8"])
def test_rows_stay_inside_pages_and_halves(adapters, adapter_dtype):
    root, _ = adapters
    man = manifest(adapter_dtype=adapter_dtype)
    reg = AdapterRegistry(man)
    reg.register(LoRARequest("mlp16rs", 1, str(root / "mlp16rs")))
    pages = tuple(np.random.default_rng(1).permutation(NUM_PAGES)[: reg.num_pages_needed(1)])
    step = reg.lora_step_inputs([(0, 1, pages)], NUM_PAGES)
    pe, used = man.page_elems, []
    for m, dims in man.lora_targets.items():
        r = step[lora_input_name(m, "ranks")][:, 0].max()
        for kind, n in (("a_offsets", dims["in"]), ("b_offsets", dims["out"])):
            n = row_elems(n, adapter_dtype)  # pool elements of the row
            for o in step[lora_input_name(m, kind)][0, :r].tolist():
                assert o // pe == (o + n - 1) // pe, f"{m} row at {o} straddles a page half"
                assert (o // pe) % NUM_PAGES in pages
                used.append((o, o + n))
    used.sort()
    assert all(e <= s for (_, e), (s, _) in zip(used, used[1:])), "rows overlap"


@pytest.mark.parametrize("dtype, tag", [("bfloat16", "BF16"), ("float16", "F16")])
def test_half_precision_adapter_loads(tmp_path, dtype, tag):
    model = make_adapter(tmp_path / "half", 11, dtype=getattr(torch, dtype), r=4, lora_alpha=8,
                         target_modules=["q_proj", "down_proj"])  # fmt: skip
    raw = (tmp_path / "half/adapter_model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {tag}
    reg = AdapterRegistry(manifest())
    w = reg.register(LoRARequest("half", 1, str(tmp_path / "half"))).modules["down_proj"]
    lin = model.base_model.model.model.layers[1].mlp.down_proj
    a = lin.lora_A["default"].weight.detach().float().numpy()  # [r, in]
    b = lin.lora_B["default"].weight.detach().float().numpy()  # [out, r]
    np.testing.assert_array_equal(w.layer_a(1), a)
    np.testing.assert_array_equal(w.layer_bt(1), b.T)


# --- refusals ---------------------------------------------------------------------------------


def edited_copy(src, dst, **config_changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(config_changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_dora": True}, "no matching lora_magnitude_vector.*use_dora: true"),  # no m
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"r": 5}, "r=5"),
        ({"target_modules": ["k_proj"]}, "does not select"),
        ({"peft_type": "IA3"}, "peft_type"),
    ],
)
def test_refuses_bad_config(adapters, tmp_path, change, message):
    root, _ = adapters
    bad = edited_copy(root / "qv4", tmp_path / "bad", **change)
    reg = AdapterRegistry(manifest())
    with pytest.raises(AdapterError, match=message):
        reg.register(LoRARequest("bad", 1, str(bad)))
    assert "bad" not in reg and len(reg) == 0


def test_refuses_pickle_weights(adapters, tmp_path):
    root, _ = adapters
    bad = shutil.copytree(root / "qv4", tmp_path / "pickled")
    (bad / "adapter_model.safetensors").rename(bad / "adapter_model.bin")
    reg = AdapterRegistry(manifest())
    with pytest.raises(AdapterError, match="safetensors only"):
        reg.register(LoRARequest("p", 1, str(bad)))
    with pytest.raises(AdapterError, match="safetensors only"):
        reg.register(LoRARequest("p", 1, str(bad / "adapter_model.bin")))


@pytest.mark.parametrize(
    "edit, message, unshown",
    [
        (lambda t: t.update({"base_model.model.lm_head.lora_A.weight": np.ones((4, 64))}),
         r"tensor #\d+ of the header is not named as a LoRA A/B weight of a layer", "lm_head"),
        (lambda t: t.pop("base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"),
         r"tensor 'layers\.1\.v_proj\.lora_A\.weight' has no matching lora_B", "self_attn"),
        (lambda t: t.update({"base_model.model.model.layers.0.self_attn.rotary.lora_A.weight":
                             np.ones((4, 64)), "base_model.model.model.layers.0.self_attn.rotary"
                             ".lora_B.weight": np.ones((64, 4))}),
         r"targets a module; supported LoRA modules are \['q_proj'", "rotary"),
    ],
)  # fmt: skip
def test_refuses_bad_tensors(adapters, tmp_path, edit, message, unshown):
    """Each names the rule; a tensor is named by the module and layer it was checked to be
    for, never by its name in the file (file contents), nor the file by its full path."""
    from safetensors.numpy import load_file, save_file

    root, _ = adapters
    bad = shutil.copytree(root / "qv4", tmp_path / "bad")
    tensors = load_file(bad / "adapter_model.safetensors")
    edit(tensors)
    tensors = {k: v.astype(np.float32) for k, v in tensors.items()}
    save_file(tensors, bad / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=message) as info:
        AdapterRegistry(manifest()).register(LoRARequest("bad", 1, str(bad)))
    assert unshown not in str(info.value) and str(tmp_path) not in str(info.value)
    assert str(info.value).startswith("adapter 'bad': adapter_model.safetensors: ")


@pytest.mark.parametrize(
    "dtype, value",
    [(np.float32, np.nan), (np.float32, -np.inf), (np.float64, 1e300)],  # 1e300: inf as float32
)
def test_refuses_values_not_finite_naming_the_tensor(adapters, tmp_path, dtype, value):
    from safetensors.numpy import load_file, save_file

    root, _ = adapters
    bad = shutil.copytree(root / "qv4", tmp_path / "bad")
    tensors = load_file(bad / "adapter_model.safetensors")
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors = {k: v.astype(dtype) for k, v in tensors.items()}
    tensors[name][3, 1] = value
    save_file(tensors, bad / "adapter_model.safetensors")
    shown = re.escape("'layers.1.v_proj.lora_B.weight'")
    with pytest.raises(AdapterError, match=rf"tensor {shown} holds 1 NaN or inf") as info:
        AdapterRegistry(manifest()).register(LoRARequest("bad", 1, str(bad)))
    assert name not in str(info.value)


def test_refuses_truncated_safetensors(adapters, tmp_path):
    root, _ = adapters
    bad = shutil.copytree(root / "qv4", tmp_path / "bad")
    data = (bad / "adapter_model.safetensors").read_bytes()
    (bad / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(AdapterError, match="does not fit"):
        AdapterRegistry(manifest()).register(LoRARequest("bad", 1, str(bad)))


def test_refuses_adapter_of_another_base_model(tmp_path):
    make_adapter(tmp_path / "wide", 3, config=tiny_config(hidden=96), r=4, lora_alpha=8,
                 target_modules=["q_proj"])  # fmt: skip
    with pytest.raises(AdapterError, match=r"q_proj\.lora_A\.weight.*\[4, 96\].*in=64"):
        AdapterRegistry(manifest()).register(LoRARequest("wide", 1, str(tmp_path / "wide")))


def test_refuses_module_not_exported(adapters):
    root, _ = adapters
    reg = AdapterRegistry(manifest(targets=("q_proj", "k_proj")))
    with pytest.raises(AdapterError, match="'v_proj', which the exported model does not target"):
        reg.register(LoRARequest("qv4", 1, str(root / "qv4")))


def test_refuses_layer_out_of_range(adapters):
    root, _ = adapters
    with pytest.raises(AdapterError, match="layer 1; the model has layers 0..0"):
        AdapterRegistry(manifest(layers=1)).register(LoRARequest("qv4", 1, str(root / "qv4")))


def test_refuses_path_outside_root(adapters, tmp_path):
    root, _ = adapters
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "link").symlink_to(root / "qv4")
    reg = AdapterRegistry(manifest(), adapter_root=allowed)
    for path in (root / "qv4", allowed / "link", allowed / ".." / ".." / "x"):
        with pytest.raises(AdapterPathError, match="outside the adapter root"):
            reg.register(LoRARequest("x", 1, str(path)))


def test_duplicate_and_unknown_names(adapters):
    root, _ = adapters
    reg = AdapterRegistry(manifest())
    req = LoRARequest("qv4", 1, str(root / "qv4"))
    reg.register(req)
    reg.register(req)  # identical: a no-op
    with pytest.raises(AdapterError, match="already registered"):
        reg.register(LoRARequest("qv4", 2, str(root / "qv4")))
    with pytest.raises(AdapterError, match="already registered"):
        reg.register(LoRARequest("other", 1, str(root / "all8")))
    with pytest.raises(AdapterNotFoundError, match="adapter not found: 'nope'"):
        reg.get("nope")
    assert reg.unregister(1) == req and "qv4" not in reg


def test_unload_drains_users_then_unregisters(adapters):
    """unload: the name stops resolving at once; the adapter stays (for its running users)
    until the last one is gone, and the call that ends the drain returns its id."""
    root, _ = adapters
    reg = AdapterRegistry(manifest())
    req = LoRARequest("qv4", 1, str(root / "qv4"))
    assert reg.resolve(req) == req and "qv4" in reg  # registered on first use
    reg.add_user(1)
    reg.add_user(1)
    assert reg.unload("qv4") is None and reg.requests() == [] and "qv4" in reg
    with pytest.raises(AdapterNotFoundError, match="being unloaded"):
        reg.resolve(req)
    with pytest.raises(AdapterError, match="being unloaded; retry"):
        reg.register(req)
    with pytest.raises(AdapterNotFoundError, match="being unloaded"):
        reg.unload("qv4")
    assert reg.num_pages_needed(1) > 0  # still usable by its users
    assert reg.remove_user(1) is None and reg.user_counts() == {1: 1}
    assert reg.remove_user(1) == 1 and "qv4" not in reg and reg.user_counts() == {}
    reg.register(req)  # the name is free again
    assert reg.unload(1) == 1 and "qv4" not in reg  # no users: at once


def test_host_cache_is_bounded_lru(adapters):
    root, _ = adapters
    reg = AdapterRegistry(manifest(), max_cpu_loras=2)
    for i, name in enumerate(ADAPTERS, start=1):
        reg.register(LoRARequest(name, i, str(root / name)))
        assert len(reg.cached_ids()) <= 2
    assert reg.cached_ids() == [3, 4] and reg.stats["loads"] == 4
    first = reg.get(1)  # evicted: reloaded from disk
    assert reg.stats["loads"] == 5 and reg.stats["host_misses"] == 1
    assert reg.cached_ids() == [4, 1]
    assert reg.get("qv4") is first and reg.stats["host_hits"] == 1


def test_step_inputs_of_evicted_adapters_need_no_reload(adapters):
    """A step's inputs come from what registration kept (packing, ranks, scales): adapters
    the host cache evicted are not read again, and the inputs equal those built from the
    adapters in memory."""
    root, _ = adapters
    slots = []
    for max_cpu in (1, len(ADAPTERS)):
        reg = AdapterRegistry(manifest(), max_cpu_loras=max_cpu)
        for i, name in enumerate(ADAPTERS, start=1):
            reg.register(LoRARequest(name, i, str(root / name)))
        loads = reg.stats["loads"]
        pages = [tuple(range(10 * i, 10 * i + reg.num_pages_needed(i))) for i in (1, 2, 3, 4)]
        slots.append(reg.lora_step_inputs([(i - 1, i, pg) for i, pg in enumerate(pages, 1)], 64))
        assert reg.stats["loads"] == loads and reg.stats["host_misses"] == 0
    assert slots[0].keys() == slots[1].keys()
    for name in slots[0]:
        np.testing.assert_array_equal(slots[0][name], slots[1][name], err_msg=name)


def test_reload_of_changed_files_is_refused(adapters, tmp_path):
    """An evicted adapter whose files changed since registration (here its rank) is not
    served with the registered layout: the reload names the adapter and says so."""
    root, _ = adapters
    path = shutil.copytree(root / "qv4", tmp_path / "qv4")
    reg = AdapterRegistry(manifest(), max_cpu_loras=1)
    reg.register(LoRARequest("mine", 1, str(path)))
    reg.register(LoRARequest("other", 2, str(root / "all8")))  # evicts "mine"
    shutil.rmtree(path)
    shutil.copytree(root / "all8", path)  # other ranks and modules, same place
    with pytest.raises(AdapterError, match="'mine'.*changed since it was registered"):
        reg.get("mine")
