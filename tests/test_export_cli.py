"""`ort-lora export --verify` on a tiny checkpoint: passes against its own checkpoint, fails
(non-zero exit) against a different one."""

from __future__ import annotations

import re

from ort_lora.export import verify
from ort_lora.export.cli import main as export_main
from ort_lora.export.tiny import tiny_config, write_random_checkpoint


def test_verify_passes_and_prints_max_difference(tiny_llama_checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    rc = export_main(
        [
            str(tiny_llama_checkpoint),
            str(out),
            "--block-size",
            "8",
            "--verify",
            "--quiet",
            "--extra",
            "verify_steps=5",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    diff = float(re.search(r"max \|logits - transformers\| = (\S+)", text).group(1))
    assert diff <= 1e-4 and "OK" in text
    assert (out / "model.onnx").is_file() and (out / "model.onnx.data").is_file()


def test_verify_fails_against_other_weights(tiny_llama_checkpoint, tmp_path, monkeypatch, capsys):
    other = write_random_checkpoint(tmp_path / "other", tiny_config("llama"), seed=99)
    real_loader = verify.load_reference
    monkeypatch.setattr(verify, "load_reference", lambda _path: real_loader(other))
    rc = export_main(
        [
            str(tiny_llama_checkpoint),
            str(tmp_path / "out"),
            "--block-size",
            "8",
            "--verify",
            "--quiet",
            "--extra",
            "verify_steps=2",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 1 and "FAILED" in text


def test_adapter_dtype_marks_every_lora_node(tiny_llama_checkpoint, tmp_path):
    """--adapter-dtype bfloat16 / float16 / int8: every LoraSGMV node says so
    (TensorProto.BFLOAT16 = 16, FLOAT16 = 10, INT8 = 3) and the manifest records it. The
    default export (auto) carries no such attribute: every node reads the graph input
    lora_row_types as its input row_types; float32 has neither."""
    import onnx

    from ort_lora.contract import LORA_ROW_TYPES, LORA_SGMV_ROW_TYPES, ModelManifest

    # flag -> (attribute, manifest adapter_dtype, whether the nodes read lora_row_types)
    cases = {"bfloat16": (16, "bfloat16", False), "float16": (10, "float16", False),
             "int8": (3, "int8", False), "float32": (None, None, False),
             None: (None, "auto", True)}  # fmt: skip
    for flag, (want, name, row_types) in cases.items():
        out = tmp_path / f"out{flag}"
        args = [str(tiny_llama_checkpoint), str(out), "--block-size", "8", "--quiet"]
        assert export_main(args + (["--adapter-dtype", flag] if flag else [])) == 0
        model = onnx.load(str(out / "model.onnx"), load_external_data=False)
        nodes = [n for n in model.graph.node if n.op_type == "LoraSGMV"]
        attrs = [{a.name: a.i for a in n.attribute}.get("adapter_dtype") for n in nodes]
        assert nodes and attrs == [want] * len(nodes)
        reads = [list(n.input[LORA_SGMV_ROW_TYPES:]) == [LORA_ROW_TYPES] for n in nodes]
        assert reads == [row_types] * len(nodes)
        assert (LORA_ROW_TYPES in {i.name for i in model.graph.input}) == row_types
        assert ModelManifest.load(out).adapter_dtype == name
