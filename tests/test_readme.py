"""The README's code blocks run as written: its server calls against `ort-lora serve` (the
default model from a cache entry linked to the session's export), its offline API and export
blocks from a directory outside the repository.

Blocks run in order, in one temporary directory. Only two things are substituted: the
server's address (a free port instead of 8000) and where the venv lives (`source
.venv/bin/activate` names this interpreter's venv). The set-up block (`make ...`) is what CI
itself runs, and `text` blocks are output, not commands.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ort_lora.bench.harness.servers import ServeProcess
from ort_lora.server.default_model import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.slow
README = Path(__file__).parent.parent / "README.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)
README_URL = "http://127.0.0.1:8000"


def readme_blocks() -> list[tuple[str, str]]:
    """(language, code) of every fenced block that is a command to run."""
    blocks = FENCE.findall(README.read_text())
    return [(lang, code) for lang, code in blocks
            if lang in ("bash", "python") and not code.startswith("make ")]  # fmt: skip


@pytest.fixture(scope="module")
def readme_env(smollm2_default_export, tmp_path_factory) -> dict:
    """Environment of the blocks: this venv first on PATH, a model cache holding the
    session's export of the default model (so nothing is exported twice)."""
    cache = tmp_path_factory.mktemp("readme_cache")
    (cache / "models").mkdir()
    (cache / "models" / DEFAULT_MODEL_NAME).symlink_to(smollm2_default_export)
    env = dict(os.environ, ORT_LORA_CACHE=str(cache))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


@pytest.fixture(scope="module")
def readme_server(readme_env):
    """`ort-lora serve` as the README's first command starts it (on another port)."""
    with ServeProcess([], env=readme_env, startup_timeout_s=300) as url:
        yield url


def _run(lang: str, code: str, env: dict, cwd: Path) -> str:
    venv = Path(sys.executable).parent
    code = code.replace("source .venv/bin/activate", f"source {venv}/activate")
    cmd = (
        ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    )
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"README {lang} block failed:\n{code}\n{done.stdout}{done.stderr}"
    return done.stdout


def test_readme_blocks_run_as_written(readme_server, readme_env, tmp_path):
    url = readme_server
    blocks = readme_blocks()
    assert len(blocks) >= 6, "the README lost its examples"
    outputs = []
    for lang, code in blocks:
        outputs.append(_run(lang, code.replace(README_URL, url), readme_env, tmp_path))
    text = "\n".join(outputs)
    assert "THE SKY IS BLUE." in text  # the curl call and the offline API, on `upper`
    assert '"country"' in text  # the structured output
    assert (tmp_path / "out" / "smollm2-int4" / "model.onnx").is_file()
