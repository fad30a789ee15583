"""Every number an adapter brings to LoraSGMV is checked, in the type the kernel uses, before a
step sees it: composed weights (finite in float32, |w| <= MAX_WEIGHT, numbers only), scalings
(lora_alpha / r finite in float32, |s| <= MAX_SCALE), the scaled product s B A (its gains under
MAX_GAIN, its values finite in the rows' storage type), DoRA factors; adapter_config.json
nested too deep is an AdapterError; errors never show resolved paths or the file's tensor names.

Lowest layer that proves it: the registry over test_adapters' hand-made manifest (no model),
one engine for the "refused before any step" check.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest

from ort_lora.adapters import AdapterError, AdapterPathError, AdapterRegistry, CompositionError
from ort_lora.adapters.bounds import MAX_GAIN, check_dora
from ort_lora.adapters.safetensors_io import SafetensorsFile
from ort_lora.lora_request import MAX_WEIGHT, LoRARequest

pytest.importorskip("torch")
pytest.importorskip("peft")
from safetensors.numpy import load_file, save_file  # noqa: E402
from test_adapters import make_adapter, manifest  # noqa: E402

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
A_NAME = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"


@pytest.fixture(scope="module")
def qv4(tmp_path_factory):
    """A valid rank-4 adapter on q_proj and v_proj (scaling 8 / 4 = 2)."""
    path = tmp_path_factory.mktemp("limits") / "qv4"
    make_adapter(path, 0, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return path


def copy(src, dst, config=None, tensors=None):
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / CONFIG).read_text())
        (dst / CONFIG).write_text(json.dumps(cfg | config))
    if tensors is not None:
        t = load_file(str(dst / WEIGHTS))
        tensors(t)
        save_file(t, str(dst / WEIGHTS))
    return dst


def register(path, m=None):
    return AdapterRegistry(m or manifest()).register(LoRARequest("bad", 1, str(path)))


def scaled(factor_a, factor_b):
    def edit(t):
        for k in t:
            t[k] = t[k] * (factor_a if "lora_A" in k else factor_b)

    return edit


# --- composed weights ----------------------------------------------------------------------


@pytest.mark.parametrize("weight", [1e308, 1e30, -1e4, 10**400, True, "1", np.bool_(True)])
def test_lora_request_refuses_weights_out_of_float32_range_or_not_numbers(weight):
    with pytest.raises(ValueError, match=r"adapter 'a': weight must be a finite number with "
                       rf"\|weight\| <= {MAX_WEIGHT:g}"):  # fmt: skip
        LoRARequest("a", 1, "/x", weight)


def test_lora_request_takes_any_real_number_as_a_float():
    assert LoRARequest("a", 1, "/x", np.float32(0.25)).weight == 0.25
    assert LoRARequest("a", 1, "/x", -MAX_WEIGHT).weight == -MAX_WEIGHT
    assert type(LoRARequest("a", 1, "/x", 2).weight) is float


@pytest.mark.parametrize(
    "weight, message",
    [(1e308, "is out of range"), (1e30, "is out of range"), (-1001, "is out of range"),
     (10**400, "is out of range"), (True, "is not a number"), ("1", "is not a number")],
)  # fmt: skip
def test_registry_composition_refuses_weights_by_name(qv4, weight, message):
    reg = AdapterRegistry(manifest())
    reg.register(LoRARequest("qv4", 1, str(qv4)))
    with pytest.raises(CompositionError, match=f"adapter 'qv4': weight .* {message}"):
        reg.composition([("qv4", weight)])
    assert reg.composition([("qv4", MAX_WEIGHT)]) == ((1, MAX_WEIGHT),)


def test_engine_refuses_a_huge_weight_before_any_step(tiny_llama_export, tiny_qv_adapter):
    """A weight that got past LoRARequest (a client building requests its own way) is refused
    by add_request: nothing is queued, and the next step runs fine."""
    from ort_lora import LLM
    from ort_lora.sampling_params import SamplingParams

    llm = LLM(tiny_llama_export, num_pages=128, max_loras=2)
    for weight in (1e308, 1e30):
        lora = LoRARequest("qv", 1, str(tiny_qv_adapter))
        object.__setattr__(lora, "weight", weight)
        with pytest.raises(CompositionError, match=r"adapter 'qv': weight .* is out of range"):
            llm.engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2), [lora])
        assert not llm.engine.has_unfinished_requests()
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], params)
    assert out[0].finished and len(out[0].outputs[0].token_ids) == 2


# --- scalings and the scaled product --------------------------------------------------------


@pytest.mark.parametrize(
    "config, message",
    [
        ({"lora_alpha": 1e308}, r"lora_alpha must be a finite number \(in float32"),
        ({"lora_alpha": 3e38}, r"scaling lora_alpha / r = 3e\+38 / 4 = 7.5e\+37 is out of range"),
        ({"lora_alpha": -1e6}, r"scaling lora_alpha / r = -1e\+06 / 4 = -2.5e\+05 is out of"),
        ({"alpha_pattern": {"v_proj": 1e7}},
         r"v_proj of layer \d: scaling alpha_pattern\['v_proj'\] / r = 1e\+07 / 4 = 2.5e\+06"),
        ({"alpha_pattern": {"v_proj": 1e39}}, r"alpha_pattern\['v_proj'\] must be a finite"),
        ({"lora_alpha": 1e6, "use_rslora": True},
         r"scaling lora_alpha / sqrt\(r\) = 1e\+06 / sqrt\(4\) = 5e\+05 is out of range"),
        ({"lora_alpha": 10**400}, "lora_alpha must be a finite number"),
    ],
)  # fmt: skip
def test_scalings_beyond_float32_or_max_scale_are_refused_by_field(qv4, tmp_path, config, message):
    bad = copy(qv4, tmp_path / "bad", config=config)
    with pytest.raises(AdapterError, match=message) as info:
        register(bad)
    assert str(info.value).startswith("adapter 'bad': ")


SHRINK = r"\|scaling\| \* \|\|A\|\| = .* is out of range"  # s A x
DELTA = r"\|scaling\| \* \|\|A\|\| \* max \|\|B row\|\| = .* is out of range"  # s B A x


@pytest.mark.parametrize(
    "factors, rule",
    [((1e19, 1e19), f"({SHRINK}|{DELTA})"), ((1, 1e30), DELTA), ((10, 1e6), DELTA),
     ((1e36, 1e-36), SHRINK)],
)  # fmt: skip
def test_finite_weights_whose_scaled_product_overflows_are_refused(qv4, tmp_path, factors, rule):
    """Every stored value is finite in float32; s B A (or s A x) is not bounded under it."""
    bad = copy(qv4, tmp_path / "bad", tensors=scaled(*factors))
    assert all(np.isfinite(v).all() for v in load_file(str(bad / WEIGHTS)).values())
    with pytest.raises(AdapterError, match=rf"adapter 'bad': {WEIGHTS}: (q|v)_proj of layer \d: "
                       + rule):  # fmt: skip
        register(bad)


def test_values_must_fit_the_storage_type(qv4, tmp_path):
    """7e4 is finite in float32, not in float16: refused where the rows are stored as float16."""

    def big(t):
        t[A_NAME][0, 0] = 7e4

    bad = copy(qv4, tmp_path / "bad", tensors=big)
    register(bad)  # float32 rows: its gains are fine
    with pytest.raises(AdapterError, match=r"v_proj of layer 1: a LoRA weight of magnitude 7e\+04"
                       " does not fit the float16 rows"):  # fmt: skip
        register(bad, dataclasses.replace(manifest(), dtype="float16"))


def test_dora_factors_are_bounded():
    check_dora("DoRA adapter 'd'", "q_proj", 0, np.array([1.0, -MAX_GAIN]), "float32")
    for g, storage in ((2 * MAX_GAIN, "float32"), (7e4, "float16"), (np.inf, "float32")):
        with pytest.raises(AdapterError, match=r"q_proj of layer 0, output row 1: the DoRA factor"):
            check_dora("DoRA adapter 'd'", "q_proj", 0, np.array([1.0, g]), storage)


# --- JSON nesting and what errors show -------------------------------------------------------


def test_config_nested_deeper_than_the_parser_is_an_adapter_error(qv4, tmp_path):
    bad = copy(qv4, tmp_path / "bad")
    (bad / CONFIG).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(AdapterError, match=f"adapter 'bad': {CONFIG}: not valid JSON"):
        register(bad)
    (bad / CONFIG).write_text('{"r": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(AdapterError, match="nested too deeply"):
        register(bad)


def test_header_errors_do_not_show_tensor_names(tmp_path):
    secret = "root:x:0:0:SECRET"
    blob = json.dumps({secret: {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}).encode()
    (tmp_path / WEIGHTS).write_bytes(len(blob).to_bytes(8, "little") + blob + b"\0" * 8)
    with pytest.raises(AdapterError, match=r"tensor #0 of the header has a dtype that") as info:
        SafetensorsFile(tmp_path / WEIGHTS)
    assert "SECRET" not in str(info.value) and "I64" not in str(info.value)
    assert str(tmp_path) not in str(info.value)


def test_unknown_tensor_name_is_not_shown(qv4, tmp_path):
    def rename(t):
        t["x.SECRET-NAME.weight"] = t.pop(A_NAME)

    bad = copy(qv4, tmp_path / "bad", tensors=rename)
    with pytest.raises(AdapterError, match="of the header is not named as a LoRA") as info:
        register(bad)
    assert "SECRET" not in str(info.value) and str(tmp_path) not in str(info.value)


def test_path_errors_show_the_path_given_not_where_it_resolves(qv4, tmp_path):
    root, outside = tmp_path / "root", tmp_path / "elsewhere-SECRET"
    root.mkdir()
    shutil.copytree(qv4, outside)
    (root / "dir-link").symlink_to(outside)
    (root / "files").mkdir()
    for name in (CONFIG, WEIGHTS):
        (root / "files" / name).symlink_to(outside / name)
    os.symlink(root / "loop", root / "loop")
    reg = AdapterRegistry(manifest(), adapter_root=root)
    cases = [("dir-link", AdapterPathError, "adapter path 'dir-link' resolves outside"),
             ("files", AdapterPathError, f"adapter path 'files' \\(its {CONFIG}\\) resolves"),
             ("loop", AdapterError, "adapter path 'loop' cannot be resolved")]  # fmt: skip
    for path, error, message in cases:
        with pytest.raises(error, match=message) as info:
            reg.register(LoRARequest("x", 1, path))
        assert "SECRET" not in str(info.value) and str(root) not in str(info.value)
