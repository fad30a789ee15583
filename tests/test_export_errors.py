"""Bad input to the exporter: an ExportError naming the problem, and from the CLI a message
and a non-zero exit, never a stack trace."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ort_lora.export import ExportError, export_model
from ort_lora.export.cli import main as export_main
from ort_lora.export.tiny import tiny_config, write_random_checkpoint


def _cli(args: list[str], capsys) -> tuple[int, str]:
    rc = export_main(args)
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


def test_missing_directory(tmp_path, capsys):
    with pytest.raises(ExportError, match="does not exist"):
        export_model(tmp_path / "nope", tmp_path / "out", progress=False)
    rc, text = _cli([str(tmp_path / "nope"), str(tmp_path / "out")], capsys)
    assert rc == 1 and "does not exist" in text and "Traceback" not in text


def test_missing_directory_from_the_installed_command(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ort_lora.cli", "export", str(tmp_path / "nope"), str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_directory_without_weights(tmp_path, capsys):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(tiny_config("llama")))
    with pytest.raises(ExportError, match="no weights"):
        export_model(tmp_path / "ckpt", tmp_path / "out", progress=False)
    rc, text = _cli([str(tmp_path / "ckpt"), str(tmp_path / "out")], capsys)
    assert rc == 1 and "no weights" in text and "Traceback" not in text


def test_directory_without_config(tmp_path):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ExportError, match="no config.json"):
        export_model(tmp_path / "ckpt", tmp_path / "out", progress=False)


def test_unsupported_architecture_lists_supported(tmp_path, capsys):
    config = tiny_config("llama", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"")
    rc, text = _cli([str(tmp_path / "ckpt"), str(tmp_path / "out")], capsys)
    assert rc == 1 and "GPT2LMHeadModel" in text
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in text
    assert "Traceback" not in text


def test_gguf_without_gguf_package(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGUF" + bytes(64))
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    with pytest.raises(ExportError, match="needs the `gguf` package"):
        export_model(fake, tmp_path / "out", progress=False)
    rc, text = _cli([str(fake), str(tmp_path / "out")], capsys)
    assert rc == 1 and "pip install" in text and "Traceback" not in text


def test_existing_outdir_needs_force(tiny_llama_checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    export_model(tiny_llama_checkpoint, out, block_size=8, progress=False)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(ExportError, match="--force"):
        export_model(tiny_llama_checkpoint, out, block_size=8, progress=False)
    rc, text = _cli([str(tiny_llama_checkpoint), str(out), "--block-size", "8"], capsys)
    assert rc == 1 and "--force" in text and "Traceback" not in text
    assert sorted(p.name for p in out.iterdir()) == before
    rc, text = _cli(
        [
            str(tiny_llama_checkpoint),
            str(out),
            "--block-size",
            "8",
            "--force",
            "--quiet",
            "--lora-targets",
            "q_proj,v_proj",
        ],
        capsys,
    )
    assert rc == 0
    manifest = json.loads((out / "ort_lora_manifest.json").read_text())
    assert list(manifest["lora_targets"]) == ["q_proj", "v_proj"]


def test_force_never_replaces_a_foreign_directory(tiny_llama_checkpoint, tmp_path):
    out = tmp_path / "precious"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not an ort-lora export"):
        export_model(tiny_llama_checkpoint, out, block_size=8, force=True, progress=False)
    assert (out / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lora_targets": "q_proj,w_proj"}, "unknown LoRA target module"),
        ({"dtype": "int8"}, "unknown dtype"),
        ({"device": "tpu"}, "unknown device"),
        ({"dtype": "float16"}, "not supported on device cpu"),
        ({"block_size": 2}, "--block-size >= 4"),  # 2 * 2 * 16 = 64 < 128
        ({"block_size": 0}, "positive integer"),
        ({"device": "cuda", "dtype": "float16"}, "power of two >= 16"),  # block 8
        ({"adapter_dtype": "int4"}, "adapter dtype 'int4' is not supported on device cpu"),
        (
            {"device": "cuda", "dtype": "float16", "block_size": 16, "adapter_dtype": "bfloat16"},
            "use float16",
        ),
        (
            {"device": "cuda", "dtype": "float16", "block_size": 16, "adapter_dtype": "int8"},
            "adapter dtype 'int8' is not supported on device cuda",
        ),  # fmt: skip
        ({"device": "cuda", "dtype": "float16", "block_size": 24}, "power of two >= 16"),
        ({"extra": {"colour": "blue"}}, "unknown --extra key"),
    ],
)
def test_bad_options(tiny_llama_checkpoint, tmp_path, kwargs, message):
    kwargs = {"block_size": 8, **kwargs}
    with pytest.raises(ExportError, match=message):
        export_model(tiny_llama_checkpoint, tmp_path / "out", progress=False, **kwargs)
    assert not (tmp_path / "out").exists()


def test_tensor_with_wrong_shape_is_named(tmp_path):
    ckpt = write_random_checkpoint(tmp_path / "ckpt", tiny_config("llama"), seed=3)
    config = json.loads((ckpt / "config.json").read_text())
    config["intermediate_size"] = 96  # the weights say 128
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="gate_proj.weight has shape"):
        export_model(ckpt, tmp_path / "out", block_size=8, progress=False)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.*"))  # the temporary directory is gone


def test_bad_extra_and_usage_errors(tiny_llama_checkpoint, tmp_path, capsys):
    rc, text = _cli([str(tiny_llama_checkpoint), str(tmp_path / "o"), "--extra", "oops"], capsys)
    assert rc == 1 and "KEY=VALUE" in text
    rc, text = _cli([str(tiny_llama_checkpoint)], capsys)  # OUTDIR missing: argparse usage
    assert rc == 2 and "usage" in text and "Traceback" not in text


def test_inconsistent_config_is_named(tmp_path):
    ckpt = write_random_checkpoint(tmp_path / "ckpt", tiny_config("llama"), seed=4)
    config = json.loads((ckpt / "config.json").read_text())
    config["num_key_value_heads"] = 3  # 4 query heads cannot share 3 KV heads
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match="not a multiple of num_key_value_heads 3"):
        export_model(ckpt, tmp_path / "out", block_size=8, progress=False)


def test_cuda_export_refuses_a_head_size_orts_rotary_cannot_take(tmp_path):
    """ORT's CUDA PagedAttention checks head_size % 16 whenever cos/sin caches are given (they
    always are): head_dim 24 would fail at the first step, so export refuses it by name."""
    config = tiny_config("llama", head_dim=24, hidden_size=96)
    ckpt = write_random_checkpoint(tmp_path / "ckpt", config, seed=5)
    message = "head_dim 24: ORT's CUDA PagedAttention with rotary embeddings needs a multiple of 16"
    with pytest.raises(ExportError, match=message):
        export_model(ckpt, tmp_path / "out", device="cuda", dtype="float16", progress=False)
    assert not (tmp_path / "out").exists()
