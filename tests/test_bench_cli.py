"""`ort-lora bench --quick` end to end on the tiny random model: the files and their schema,
never a speed. Plus bad command lines and the .onnx_adapter conversion (vs the PEFT tensors).

With onnxruntime-genai installed (the `bench` extra) the quick run exercises its two systems
too; without it they are skipped and the results say so. vLLM (a peer venv) is never installed
by --quick: its systems are skipped in the fresh cache directory and the notes say so.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from ort_lora.bench import output, plan
from ort_lora.bench.cli import main

HAS_GENAI = importlib.util.find_spec("onnxruntime_genai") is not None


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_out")
    cache = tmp_path_factory.mktemp("bench_cache")
    rc = main(["--quick", "--out", str(out), "--cache-dir", str(cache)])
    return rc, out, cache


def _expected_runs():
    systems = {s for s, _, _ in plan.SYSTEM_ROWS} - set(plan.PEER_SYSTEMS)
    if not HAS_GENAI:
        systems -= set(plan.GENAI_SYSTEMS)
    return plan.experiments(plan.QUICK, 256, systems)


@pytest.mark.slow
def test_quick_run_writes_every_file(quick_run):
    rc, out, _ = quick_run
    log = (out / "bench.log").read_text()
    assert rc == 0, f"some runs failed; bench.log tail:\n{log[-3000:]}"
    for name in ("results.json", "report.md", "popularity.png", "registered.png"):
        assert (out / name).is_file(), name
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    # one per systems shape, popularity, registered, trace latency, quant (both shapes),
    # grammar (step time by phase)
    assert len(list(out.glob("*.png"))) == len(plan.QUICK.shapes) + 5


@pytest.mark.slow
def test_quick_results_schema(quick_run):
    _, out, _ = quick_run
    doc = json.loads((out / "results.json").read_text())
    assert doc["schema"] == output.SCHEMA
    assert {"command", "date", "machine", "cpu", "threads", "notes"} <= set(doc["meta"])
    assert doc["meta"]["command"].startswith("ort-lora bench --quick")
    assert "ort-lora adapters copied into the pool at registration" in doc["meta"]["notes"]
    expected = _expected_runs()
    assert [(r["experiment"], r["label"]) for r in doc["results"]] == [
        (r["experiment"], r["label"]) for r in expected
    ]
    for row, run in zip(doc["results"], expected):
        assert "error" not in row, row
        assert set(output.ROW_KEYS) <= set(row), row["label"]
        assert row["output_tokens"] == run["workload"].output_tokens
        assert row["output_tok_s"] > 0 and row["peak_rss_mb"] > 0 and row["cpu_s"] > 0
        assert row["ttft_p50_ms"] <= row["ttft_p99_ms"]
    if not HAS_GENAI:
        assert any("onnxruntime-genai" in n for n in doc["meta"]["notes"])
    assert any(n.startswith("vllm systems skipped") for n in doc["meta"]["notes"])
    keys = {"what", "measured", "measured_cpu", "goal"}
    assert doc["targets"] and all(keys == set(t) for t in doc["targets"])


@pytest.mark.slow
def test_quick_report_has_every_table(quick_run):
    _, out, _ = quick_run
    text = (out / "report.md").read_text()
    assert "ort-lora bench --quick" in text
    sections = ("## Targets", "## systems/decode-heavy", "## popularity", "## trace")
    for section in (*sections, "## quant/decode-heavy", "## quant/prefill-heavy", "## grammar"):
        assert section in text
    assert "grammar masking at 8 seqs: step time added / step" in text
    assert "| ort-lora json_schema | 8 |" in text  # its step time by phase
    for system, label, _ in plan.SYSTEM_ROWS:
        if (HAS_GENAI or "genai" not in label) and system not in plan.PEER_SYSTEMS:
            assert f"| {label} |" in text


@pytest.mark.slow
def test_rewrite_of_one_unshaped_experiment(quick_run, tmp_path):
    """`python -m ort_lora.bench.output DIR` on a run of the grammar experiment alone (no
    systems or quant rows to take the shapes from) rewrites its report."""
    _, out, _ = quick_run
    doc = json.loads((out / "results.json").read_text())
    doc["results"] = [r for r in doc["results"] if r["experiment"] == "grammar"]
    assert doc["results"]
    (tmp_path / "results.json").write_text(json.dumps(doc))
    paths = output.rewrite(tmp_path)
    assert tmp_path / "grammar_steps.png" in paths
    assert "| ort-lora json_schema | 8 |" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
@pytest.mark.skipif(not HAS_GENAI, reason="onnxruntime-genai not installed (bench extra)")
def test_onnx_adapter_holds_the_peft_tensors(quick_run):
    import onnxruntime as ort
    from safetensors.numpy import load_file

    _, _, cache = quick_run
    adapter = cache / "tiny" / "adapters_r16_s0" / "a1"
    fmt = ort.AdapterFormat.read_adapter(
        str(cache / "tiny" / "genai_lora" / "adapters" / "a1.onnx_adapter")
    )
    params = {k: v.numpy() for k, v in fmt.get_parameters().items()}
    config = json.loads((adapter / "adapter_config.json").read_text())
    peft = load_file(adapter / "adapter_model.safetensors")
    scale = config["lora_alpha"] / config["r"]
    key = "base_model.model.model.layers.1.self_attn.k_proj.lora_{}.weight"
    name = "model.layers.1.attn.k_proj.lora_{}.MatMul.weight"
    np.testing.assert_array_equal(params[name.format("A")], peft[key.format("A")].T)
    np.testing.assert_allclose(params[name.format("B")], scale * peft[key.format("B")].T, rtol=1e-6)
    assert len(params) == 2 * 7 * 2  # A and B x seven modules x two layers


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--systems", "sglang"], "--systems: unknown ['sglang']"),
        (["--experiments", "speed"], "--experiments: unknown ['speed']"),
        (["--threads", "0"], "--threads and --rank must be >= 1"),
    ],
)
def test_bad_arguments_name_the_problem(argv, message, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not HAS_GENAI, reason="onnxruntime-genai not installed (bench extra)")
def test_genai_multilora_logits_match_peft(quick_run):
    """System 5 really applies the active adapter: its logits equal PEFT's, per adapter."""
    import onnxruntime_genai as og
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tiny = quick_run[2] / "tiny"
    ids = np.random.default_rng(3).integers(64, 256, size=(1, 6))  # [1, S]
    model = og.Model(str(tiny / "genai_lora"))
    adapters = og.Adapters(model)
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny / "hf", dtype=torch.float32),
        tiny / "adapters_r16_s0" / "a0",
        adapter_name="a0",
    )
    for name in ("a0", "a2"):
        adapters.load(str(tiny / "genai_lora" / "adapters" / f"{name}.onnx_adapter"), name)
        if name != "a0":
            peft.load_adapter(tiny / "adapters_r16_s0" / name, adapter_name=name)
    for name in ("a2", "a0"):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=8, batch_size=1)
        gen = og.Generator(model, params)
        gen.set_active_adapter(adapters, name)
        gen.append_tokens(ids.astype(np.int32))
        peft.set_adapter(name)
        with torch.no_grad():
            want = peft(torch.from_numpy(ids)).logits[0, -1].numpy()  # [vocab]
        np.testing.assert_allclose(gen.get_logits()[0, -1], want, atol=1e-4, rtol=1e-4)


def test_bench_tools_refuse_bad_input_with_a_message(tmp_path, capsys):
    from ort_lora.bench import profile

    assert output.main([str(tmp_path)]) == 2
    assert "has no results.json" in capsys.readouterr().err
    (tmp_path / "results.json").write_text('{"results": 3}')
    assert output.main([str(tmp_path)]) == 2
    assert "is not a bench run's results" in capsys.readouterr().err
    assert profile.main([str(tmp_path / "missing.json")]) == 2
    assert "cannot read the spec" in capsys.readouterr().err
    (tmp_path / "spec.json").write_text('{"label": "x"}')  # not a spec's fields
    assert profile.main([str(tmp_path / "spec.json")]) == 2
    assert "cannot read the spec" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        profile.main(["--help"])
    assert exit_.value.code == 0
