"""The benchmark's model cache: an export made with an older op set is exported again, so a
benchmark measures what the exporter makes now; a current one is reused."""

from __future__ import annotations

import json

import pytest

from ort_lora.bench import assets
from ort_lora.contract import MANIFEST_NAME, OPS_VERSION


def _entry(path, ops_version):
    path.mkdir(parents=True)
    (path / "model.onnx").write_bytes(b"")
    manifest = {} if ops_version is None else {"ops_version": ops_version}
    (path / MANIFEST_NAME).write_text(json.dumps(manifest))


@pytest.mark.parametrize("ops_version", [None, "0.1.0"])
def test_an_export_of_an_older_op_set_is_made_again(tmp_path, monkeypatch, ops_version):
    import ort_lora.export

    calls = []

    def fake_export(src, out, **options):
        calls.append(out)
        (out / MANIFEST_NAME).write_text(json.dumps({"ops_version": OPS_VERSION}))

    monkeypatch.setattr(ort_lora.export, "export_model", fake_export)
    _entry(tmp_path / "ort_lora", ops_version)
    assert assets.ort_lora_model(tmp_path / "hf", tmp_path, block_size=16) == tmp_path / "ort_lora"
    assert calls == [tmp_path / "ort_lora"]
    assets.ort_lora_model(tmp_path / "hf", tmp_path, block_size=16)  # now current: reused
    assert len(calls) == 1
