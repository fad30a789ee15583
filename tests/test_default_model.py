"""The default model's base weights (server/default_model.py CPU_WEIGHTS): the export asks for
them, and a cache entry holding the other kind (exported before the default changed) is
exported again, atomically, while an entry holding them is reused."""

from __future__ import annotations

import json

import pytest

from ort_lora.contract import MANIFEST_NAME, OPS_VERSION
from ort_lora.server import default_model


def _manifest(weights: str, op: str = default_model.INT4_LINEAR_OP) -> dict:
    if weights in ("int4", "int8"):
        quant = {"weights": weights, "linear_op": op, "head_op": op}
        return {"dtype": "float32", "quantization": quant, "ops_version": OPS_VERSION}
    return {"dtype": weights, "quantization": {}, "ops_version": OPS_VERSION}


def _other_weights() -> str:
    return "float32" if default_model.CPU_WEIGHTS != "float32" else "int4"


def _fake_export(monkeypatch, calls: list):
    def fake_export(src, out, force, progress, **options):
        calls.append(options)
        weights = options.get("weights", options.get("dtype", "float32"))
        (out / MANIFEST_NAME).write_text(json.dumps(_manifest(weights)))
        return out

    import ort_lora.export

    monkeypatch.setattr(ort_lora.export, "export_model", fake_export)


def test_a_cache_entry_with_other_weights_is_exported_again(tmp_path, monkeypatch):
    monkeypatch.setenv("ORT_LORA_CACHE", str(tmp_path))
    target = tmp_path / "models" / default_model.DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    (target / MANIFEST_NAME).write_text(json.dumps(_manifest(_other_weights())))
    calls = []
    _fake_export(monkeypatch, calls)
    assert default_model.ensure_default_model(progress=False) == target
    assert calls == [default_model.export_options("cpu")]
    written = json.loads((target / MANIFEST_NAME).read_text())
    assert written == _manifest(default_model.CPU_WEIGHTS)
    assert default_model.ensure_default_model(progress=False) == target and len(calls) == 1


@pytest.mark.parametrize(
    "old_quant",
    [
        {"weights": "int4"},  # before QuantMatMul: linears on MatMulNBits, no linear_op
        {"weights": "int4", "linear_op": default_model.INT4_LINEAR_OP},  # head on MatMulNBits
        {"weights": "int4", "linear_op": "com.microsoft.MatMulNBits", "head_op": "x"},
    ],
)
def test_an_int4_entry_of_matmulnbits_is_exported_again(tmp_path, monkeypatch, old_quant):
    """An int4 entry exported before QuantMatMul ran its linears (no linear_op in its
    manifest) or its 8-bit LM head (no head_op) is exported again when int4 is the default;
    one with both is reused."""
    monkeypatch.setattr(default_model, "CPU_WEIGHTS", "int4")
    monkeypatch.setenv("ORT_LORA_CACHE", str(tmp_path))
    target = tmp_path / "models" / default_model.DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    old = {"dtype": "float32", "quantization": old_quant, "ops_version": OPS_VERSION}
    (target / MANIFEST_NAME).write_text(json.dumps(old))
    calls = []
    _fake_export(monkeypatch, calls)
    assert default_model.ensure_default_model(progress=False) == target and len(calls) == 1
    assert json.loads((target / MANIFEST_NAME).read_text()) == _manifest("int4")
    assert default_model.ensure_default_model(progress=False) == target and len(calls) == 1


def test_a_linked_cache_entry_with_other_weights_is_unlinked_not_deleted(tmp_path, monkeypatch):
    """An entry that is a symlink to an export elsewhere: the link is replaced, the export it
    pointed to is left as it was."""
    monkeypatch.setenv("ORT_LORA_CACHE", str(tmp_path / "cache"))
    elsewhere = tmp_path / "mine"
    elsewhere.mkdir()
    (elsewhere / MANIFEST_NAME).write_text(json.dumps(_manifest(_other_weights())))
    target = tmp_path / "cache" / "models" / default_model.DEFAULT_MODEL_NAME
    target.parent.mkdir(parents=True)
    target.symlink_to(elsewhere)
    calls = []
    _fake_export(monkeypatch, calls)
    assert default_model.ensure_default_model(progress=False) == target
    assert not target.is_symlink() and len(calls) == 1
    assert json.loads((elsewhere / MANIFEST_NAME).read_text()) == _manifest(_other_weights())


@pytest.mark.parametrize("ops_version", [None, "0.1.0"])
def test_an_entry_of_an_older_op_set_is_exported_again(tmp_path, monkeypatch, ops_version):
    """An entry holding the default weights but exported with an older op set (before
    LoraSGMV served several modules a node, say) is exported again."""
    monkeypatch.setenv("ORT_LORA_CACHE", str(tmp_path))
    target = tmp_path / "models" / default_model.DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    old = _manifest(default_model.CPU_WEIGHTS) | {"ops_version": ops_version}
    (target / MANIFEST_NAME).write_text(json.dumps(old))
    calls = []
    _fake_export(monkeypatch, calls)
    assert default_model.ensure_default_model(progress=False) == target and len(calls) == 1
    assert json.loads((target / MANIFEST_NAME).read_text())["ops_version"] == OPS_VERSION
    assert default_model.ensure_default_model(progress=False) == target and len(calls) == 1
