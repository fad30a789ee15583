"""--hide-avx512 (ort_lora/bench/hide_avx512.py): under its preload every way a library asks
what the CPU has says "no AVX-512" (GCC's __builtin_cpu_supports, as our kernels ask; numpy's
dispatcher; GCC's -march=native, as llama.cpp's build asks), other SIGSEGVs still reach the
program's own handler, and the benchmark re-runs itself under it. The machine-dependent tests
need an AVX-512 CPU that can fault on CPUID; the reasons it refuses are checked anywhere."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ort_lora.bench import hide_avx512

QUANT_TESTS = Path(__file__).with_name("test_quant_matmul.py")
WHY_NOT = hide_avx512.why_not()
needs_hiding = pytest.mark.skipif(WHY_NOT is not None, reason=f"cannot hide AVX-512: {WHY_NOT}")

PROBE = textwrap.dedent("""
    #include <stdio.h>
    int main(void) {
      __builtin_cpu_init();
      printf("%d %d %d\\n", !!__builtin_cpu_supports("avx2"),
             !!__builtin_cpu_supports("avx512f"), !!__builtin_cpu_supports("avx512vnni"));
      return 0;
    }
""")


@pytest.fixture(scope="module")
def preload(tmp_path_factory):
    return hide_avx512.library(tmp_path_factory.mktemp("cache"))


def run(cmd, env, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, **kw)


@needs_hiding
def test_cpuid_denies_avx512_to_compiled_code_numpy_and_the_compiler(preload, tmp_path):
    (tmp_path / "probe.c").write_text(PROBE)
    cc = os.environ.get("CC") or shutil.which("cc") or "gcc"
    subprocess.run(
        [cc, "-O1", "-o", str(tmp_path / "probe"), str(tmp_path / "probe.c")], check=True
    )
    hidden = hide_avx512.environment(preload)
    assert run([str(tmp_path / "probe")], os.environ).stdout.split()[:2] == ["1", "1"]
    assert run([str(tmp_path / "probe")], hidden).stdout.split() == ["1", "0", "0"]

    numpy_features = "import numpy as np; f = np._core._multiarray_umath.__cpu_features__; "
    numpy_features += "print(f['AVX2'], f['AVX512F'])"
    assert run([sys.executable, "-c", numpy_features], os.environ).stdout.split() == ["True"] * 2
    assert run([sys.executable, "-c", numpy_features], hidden).stdout.split() == ["True", "False"]

    target = run([cc, "-march=native", "-Q", "--help=target"], hidden).stdout
    enabled = {line.split()[0] for line in target.splitlines() if "[enabled]" in line}
    assert "-mavx2" in enabled
    assert not enabled & {"-mavx512f", "-mavx512vnni", "-mavxvnni", "-mamx-tile"}


@needs_hiding
def test_a_real_segfault_still_reaches_the_programs_handler(preload):
    crash = "import ctypes; ctypes.string_at(0)"
    ran = run([sys.executable, "-X", "faulthandler", "-c", crash], hide_avx512.environment(preload))
    assert ran.returncode == -11
    assert "Fatal Python error: Segmentation fault" in ran.stderr


@needs_hiding
def test_rerun_hidden_execs_the_same_command_under_the_preload(tmp_path):
    code = textwrap.dedent(f"""
        from pathlib import Path
        from ort_lora.bench import cli, hide_avx512
        hide_avx512.rerun_hidden(Path({str(tmp_path)!r}))
        print(hide_avx512.active(), cli.cpu_isa(), "avx512f" in hide_avx512.cpu_flags())
    """)
    env = {k: v for k, v in os.environ.items() if k != hide_avx512.MARK}
    ran = run([sys.executable, "-c", code], env)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["True", "AVX2", "(AVX-512", "hidden)", "False"]
    assert "re-running under" in ran.stderr
    assert list((tmp_path / "hide-avx512").glob("hide_avx512-*.so"))


def test_refuses_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.delenv(hide_avx512.MARK, raising=False)
    monkeypatch.setattr(hide_avx512, "active", lambda: False)
    monkeypatch.setattr(hide_avx512, "cpu_flags", lambda: {"avx2", "fma", "cpuid_fault"})
    with pytest.raises(SystemExit, match="no AVX-512 to hide"):
        hide_avx512.rerun_hidden(tmp_path)
    monkeypatch.setattr(hide_avx512, "cpu_flags", lambda: {"avx2", "avx512f"})
    with pytest.raises(SystemExit, match="cannot fault on CPUID"):
        hide_avx512.rerun_hidden(tmp_path)
    monkeypatch.setenv(hide_avx512.MARK, "1")  # re-run, yet the preload is not answering
    with pytest.raises(SystemExit, match="preload did not take"):
        hide_avx512.rerun_hidden(tmp_path)


def test_a_new_build_replaces_the_copies_of_earlier_sources(tmp_path):
    stale = tmp_path / "hide-avx512" / "hide_avx512-000000000000.so"
    stale.parent.mkdir()
    stale.write_bytes(b"an older build")
    lib = hide_avx512.library(tmp_path)
    assert lib.is_file() and lib != stale
    assert sorted(stale.parent.iterdir()) == [lib]
    assert hide_avx512.library(tmp_path) == lib  # built once


def test_environment_adds_to_what_is_there(tmp_path):
    env = hide_avx512.environment(
        tmp_path / "x.so", {"LD_PRELOAD": "a.so", "GLIBC_TUNABLES": "t=1"}
    )
    assert env["LD_PRELOAD"] == f"{tmp_path / 'x.so'} a.so"
    assert env["GLIBC_TUNABLES"] == f"t=1:{hide_avx512.GLIBC_TUNABLES}"
    assert env[hide_avx512.MARK] == "1"


@needs_hiding
def test_no_cpuid_on_the_hot_path(preload):
    """Each CPUID under the preload costs a signal: ONNX Runtime and the op library must ask
    at start-up only, or hidden runs would time the trap. QuantMatMul (ours) and MatMulNBits
    (MLAS) both run 50 times; the count of answered CPUIDs must not move."""
    code = textwrap.dedent(f"""
        import importlib.util, numpy as np
        from ort_lora.bench import hide_avx512
        spec = importlib.util.spec_from_file_location("tq", {str(QUANT_TESTS)!r})
        tq = importlib.util.module_from_spec(spec); spec.loader.exec_module(tq)
        rng = np.random.default_rng(0)
        q = tq.weights(rng, 96, 64, 32)
        x = rng.standard_normal((3, 64)).astype(np.float32)
        tq.run(q, x); tq.matmulnbits(q, x)
        before = hide_avx512.traps()
        for _ in range(50):
            tq.run(q, x); tq.matmulnbits(q, x)
        print(hide_avx512.active(), before > 0, hide_avx512.traps() - before)
    """)
    env = hide_avx512.environment(preload)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(QUANT_TESTS.parent), env.get("PYTHONPATH")])
    )
    ran = run([sys.executable, "-c", code], env)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.split() == ["True", "True", "0"]
