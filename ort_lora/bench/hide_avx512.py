"""Benchmarks as on an AVX2-only CPU, run on an AVX-512 one (`--hide-avx512`).

Capping only our own kernels (ORT_LORA_QUANT_ISA=avx2) is not an AVX2 comparison: ONNX
Runtime's MLAS, llama.cpp and the other peers still take their AVX-512 paths. Instead the
benchmark re-runs itself with hide_avx512.c preloaded in every process it starts, which makes
CPUID deny AVX-512, AVX-VNNI and AMX (CPUID faulting; the CPU must list `cpuid_fault`), and
with glibc told the same (GLIBC_TUNABLES), so every library picks the code it would pick on a
CPU without them. What stays is this core's microarchitecture: an AVX2 run here is not a run on
an AVX2-only AMD EPYC, and results say which it was (`cpu_isa`).

<cache>/hide-avx512/hide_avx512-<sha>.so   the preload library, compiled once with $CC or cc
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

MARK = "ORT_LORA_HIDE_AVX512"  # set in the re-run process: the preload must be answering
SOURCE = Path(__file__).with_name("hide_avx512.c")
# /proc/cpuinfo flags of what the preload hides (it cannot change that file): by prefix
HIDDEN_PREFIXES = ("avx512", "amx", "avx_vnni", "avx_ifma", "avx_ne_convert", "avx10")
# glibc picks its string functions before any preload runs: mask the same features there
GLIBC_TUNABLES = (
    "glibc.cpu.hwcaps=-AVX512F,-AVX512DQ,-AVX512CD,-AVX512BW,-AVX512VL,-AVX512_VNNI,-AVX_VNNI"
)


def cpu_flags() -> set[str]:
    """The CPU's /proc/cpuinfo flags as this process's libraries see them (less what the
    preload hides, when it is active)."""
    try:
        line = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
    except (OSError, StopIteration):
        return set()
    flags = set(line.split(":", 1)[1].split())
    hide = active()
    return {flag for flag in flags if not (hide and flag.startswith(HIDDEN_PREFIXES))}


def active() -> bool:
    """True in a process where the preload hides AVX-512 (it answers, and CPUID faults)."""
    fn = getattr(ctypes.CDLL(None), "ort_lora_hide_avx512_active", None)
    return bool(fn and fn())


def traps() -> int | None:
    """CPUIDs this process answered through the preload; None where it is not loaded."""
    fn = getattr(ctypes.CDLL(None), "ort_lora_hide_avx512_traps", None)
    if fn is None:
        return None
    fn.restype = ctypes.c_long
    return int(fn())


def why_not() -> str | None:
    """Why AVX-512 cannot be hidden on this machine, or None when it can."""
    flags = cpu_flags()
    if not flags:
        return "no /proc/cpuinfo flags (not Linux on x86)"
    if "avx512f" not in flags:
        return "this CPU has no AVX-512 to hide (run without --hide-avx512)"
    if "cpuid_fault" not in flags:
        return "this CPU or its hypervisor cannot fault on CPUID (no cpuid_fault flag)"
    if compiler() is None:
        return "no C compiler ($CC, cc, gcc) to build the preload library"
    return None


def compiler() -> str | None:
    """The C compiler the preload is built with: $CC, else cc or gcc on PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def library(cache_root: Path) -> Path:
    """The preload library under the cache, compiled when missing (RuntimeError if it
    cannot be); copies built from earlier versions of the source are removed then."""
    tag = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    lib = Path(cache_root).expanduser() / "hide-avx512" / f"hide_avx512-{tag}.so"
    if lib.is_file():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    cc = compiler() or "cc"
    tmp = lib.with_suffix(f".{os.getpid()}.tmp")
    built = subprocess.run(
        [cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE), "-ldl"],
        capture_output=True,
        text=True,
    )
    if built.returncode != 0:
        raise RuntimeError(f"{cc} failed on {SOURCE.name}: {built.stderr.strip()[-300:]}")
    tmp.replace(lib)
    for old in lib.parent.glob("hide_avx512-*.so"):
        if old != lib:
            old.unlink(missing_ok=True)  # a process that loaded it keeps its mapping
    return lib


def environment(lib: Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """env (default: this process's) with the preload and the glibc mask added."""
    out = dict(os.environ if env is None else env)
    out["LD_PRELOAD"] = " ".join(p for p in (str(lib), out.get("LD_PRELOAD", "")) if p)
    tunables = out.get("GLIBC_TUNABLES")
    out["GLIBC_TUNABLES"] = f"{tunables}:{GLIBC_TUNABLES}" if tunables else GLIBC_TUNABLES
    out[MARK] = "1"
    return out


def rerun_hidden(cache_root: Path) -> None:
    """Make this process one that sees no AVX-512: return when it already is; otherwise build
    the preload and exec this same command line under it (never returns). SystemExit with the
    reason when the machine cannot."""
    if active():
        return
    if os.environ.get(MARK):
        raise SystemExit(
            f"--hide-avx512: the preload did not take ({MARK} set, CPUID not faulting)"
        )
    why = why_not()
    if why:
        raise SystemExit(f"--hide-avx512: {why}")
    try:
        lib = library(cache_root)
    except (OSError, RuntimeError) as exc:
        raise SystemExit(f"--hide-avx512: {exc}") from None
    print(f"hide-avx512: re-running under {lib} (AVX-512, AVX-VNNI, AMX hidden)", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, environment(lib))
