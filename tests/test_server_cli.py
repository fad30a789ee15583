"""`ort-lora serve`: argument parsing, the default-model cache, and the real command serving
the tiny export in a subprocess."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest

from ort_lora.bench.harness.servers import ServeProcess
from ort_lora.contract import MANIFEST_NAME, OPS_VERSION
from ort_lora.server import default_model
from ort_lora.server.cli import build_parser, engine_overrides, main, parse_lora_module


def test_lora_modules_both_forms():
    args = build_parser().parse_args(
        ["m", "--lora-modules", "a=/x/a", '{"name": "b", "path": "/y/b", "base_model_name": "m"}']
    )
    assert args.lora_modules == [("a", "/x/a"), ("b", "/y/b")]
    args = build_parser().parse_args(["--lora-modules", "a=1", "--lora-modules", "c=3"])
    assert args.lora_modules == [("a", "1"), ("c", "3")] and args.model_dir is None


@pytest.mark.parametrize(
    "text,needle",
    [("noequals", "name=path"), ("=path", "name=path"), ("{bad json", "invalid JSON"),
     ('{"name": "a"}', '"path"'), ("[1]", "name=path")],
)  # fmt: skip
def test_lora_modules_errors(text, needle):
    with pytest.raises(argparse.ArgumentTypeError, match=needle):
        parse_lora_module(text)


def test_engine_overrides():
    args = build_parser().parse_args(
        ["m", "--max-loras", "3", "--max-num-seqs", "8", "--pool-memory-mb", "64"]
    )
    assert engine_overrides(args) == {
        "max_loras": 3,
        "max_num_seqs": 8,
        "pool_memory_bytes": 64 << 20,
    }
    no_preload = build_parser().parse_args(["m", "--no-preload-adapters"])
    assert engine_overrides(no_preload) == {"preload_adapters": False}
    for flag, value in (("--base-graph", True), ("--no-base-graph", False)):
        assert engine_overrides(build_parser().parse_args(["m", flag])) == {"base_graph": value}
    with pytest.raises(SystemExit):  # one pool size, not two
        build_parser().parse_args(["m", "--num-pages", "9", "--pool-memory-mb", "64"])


def test_bad_model_dir_is_a_clear_error(tmp_path, capsys):
    assert main([str(tmp_path / "missing"), "--port", "0"]) == 2
    assert "missing" in capsys.readouterr().err
    assert main([str(tmp_path), "--port", "0", "--adapter-root", str(tmp_path / "nope")]) == 2
    assert "--adapter-root" in capsys.readouterr().err


def test_default_model_export_is_cached_and_atomic(tmp_path, monkeypatch):
    """First use exports into a temp dir and renames it; later uses reuse it; a failed
    export leaves nothing behind."""
    monkeypatch.setenv("ORT_LORA_CACHE", str(tmp_path))
    calls = []

    def fake_export(src, out, force, progress, **options):
        calls.append((src, out, options))
        name = default_model.default_model_name(options.get("device", "cpu"))
        assert not (tmp_path / "models" / name).exists()
        if len(calls) == 1:
            (out / "partial").write_text("x")
            raise RuntimeError("disk full")
        (out / MANIFEST_NAME).write_text(json.dumps({"ops_version": OPS_VERSION}))
        return out

    import ort_lora.export

    monkeypatch.setattr(ort_lora.export, "export_model", fake_export)
    with pytest.raises(RuntimeError, match="disk full"):
        default_model.ensure_default_model(progress=False)
    models = tmp_path / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []
    target = default_model.ensure_default_model(progress=False)
    assert target == models / default_model.DEFAULT_MODEL_NAME
    assert (target / MANIFEST_NAME).is_file()
    assert calls[-1][0] == default_model.default_gguf_path()
    assert default_model.ensure_default_model(progress=False) == target and len(calls) == 2
    cuda = default_model.ensure_default_model(progress=False, device="cuda")
    assert cuda != target and cuda.parent == models and len(calls) == 3
    assert calls[-1][2] == {"device": "cuda", "dtype": "float16"}  # its own float16 export


def test_serve_command(tiny_llama_export, tmp_path):
    """The installed command serves the export with an API key and an adapter root."""
    args = [str(tiny_llama_export), "--api-key", "k", "--adapter-root", str(tmp_path)]
    args += ["--num-pages", "64", "--max-num-seqs", "4", "--log-level", "warning"]
    with ServeProcess(args, startup_timeout_s=120) as url:
        headers = {"Authorization": "Bearer k"}
        models = httpx.get(url + "/v1/models", headers=headers).json()["data"]
        assert [m["id"] for m in models] == [tiny_llama_export.name]
        body = {"model": models[0]["id"], "prompt": "hi", "max_tokens": 3, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, headers=headers)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert httpx.post(url + "/v1/completions", json=body).status_code == 401


def test_serve_device_cuda_without_a_gpu_is_refused_before_any_export(
    tmp_path, monkeypatch, capsys
):
    from ort_lora.runtime.cuda_pool import CudaError, require_cuda

    try:
        require_cuda()
        pytest.skip("CUDA is usable here: this checks the refusal on a machine without it")
    except CudaError:
        pass
    monkeypatch.setenv("ORT_LORA_CACHE", str(tmp_path))
    assert main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ort-lora serve: ") and "CUDA" in err and "Traceback" not in err
    assert not (tmp_path / "models").exists()  # refused before exporting the default model


def test_a_taken_port_is_refused_before_the_model_loads(tmp_path, capsys):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main([str(tmp_path / "no-model-here"), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "no-model-here" not in err


def test_start_up_says_what_it_serves_and_where(tiny_llama_export, tiny_qv_adapter):
    import subprocess
    import sys

    from ort_lora.bench.harness.servers import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "ort_lora.cli", "serve", str(tiny_llama_export), "--port"]
    cmd += [str(port), "--num-pages", "64", "--lora-modules", f"qv={tiny_qv_adapter}"]
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not lines or "listening on" not in lines[-1]:
            line = server.stderr.readline()
            assert line, "the server exited before saying where it listens:\n" + "".join(lines)
            lines.append(line)
    finally:
        server.terminate()
        server.wait(timeout=60)
    said = "".join(line for line in lines if line.startswith("ort-lora serve: "))
    assert f"model {tiny_llama_export.name} ({tiny_llama_export}; llama" in said
    assert "adapters qv\n" in said
    assert "pool 64 pages of" in said and "max_num_seqs" in said
    assert f"listening on http://127.0.0.1:{port} (OpenAI API under /v1)" in said
