"""The optimum system's bookkeeping, without its venv: grouping, padding, streamer stamps ->
token times, export names, and the job the peer hands its child. optimum_child.py runs in the
optimum venv, so it is loaded by path; its helpers import nothing heavy."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_module import load_script

from ort_lora.bench import peers, plan
from ort_lora.bench.spec import RunSpec
from ort_lora.bench.systems import RUNNERS, optimum_peer
from ort_lora.bench.workloads import BenchRequest, Workload

child = load_script(optimum_peer.CHILD, "optimum_child")


def _req(adapter, arrival=0.0, max_tokens=3, prompt=(5, 6)):
    return {
        "prompt_ids": list(prompt),
        "max_tokens": max_tokens,
        "adapter": adapter,
        "arrival_s": arrival,
    }


def test_groups_run_in_order_of_first_arrival():
    reqs = [_req(2, 0.5), _req(0, 0.1), _req(2, 0.0), _req(None, 0.3), _req(0, 0.2)]
    assert child.group_by_adapter(reqs) == [(2, [0, 2]), (0, [1, 4]), (None, [3])]


def test_groups_at_equal_arrivals_keep_request_order():
    reqs = [_req(i % 3) for i in range(7)] + [_req(None)]
    assert child.group_by_adapter(reqs) == [(0, [0, 3, 6]), (1, [1, 4]), (2, [2, 5]), (None, [7])]


def test_left_pad_masks_the_padding():
    ids, mask = child.left_pad([[5, 6, 7], [8], [9, 10]], pad_id=2)
    assert ids == [[5, 6, 7], [2, 2, 8], [2, 9, 10]]
    assert mask == [[1, 1, 1], [0, 0, 1], [0, 1, 1]]


def test_streamer_stamps_every_step_after_the_prompt():
    stamps = child.Stamps(t0=0.0)
    stamps.put("prompt")
    assert stamps.times == []
    for _ in range(4):
        stamps.put("token")
    stamps.end()
    assert len(stamps.times) == 4 and stamps.times == sorted(stamps.times)


def test_token_times_take_each_requests_first_steps():
    steps = [0.5, 0.6, 0.7, 0.8]
    assert child.token_times(steps, [4, 1, 2]) == [steps, [0.5], [0.5, 0.6]]
    with pytest.raises(RuntimeError, match="ran 4 steps; expected 5"):
        child.token_times(steps, [5, 1])


def test_measure_maps_each_batch_to_its_requests():
    reqs = [_req(0, max_tokens=2), _req(1, max_tokens=3), _req(0, max_tokens=1)]
    seen = []

    def run_batch(adapter, batch, t0):
        seen.append((adapter, [r["max_tokens"] for r in batch]))
        base = 10.0 * (adapter + 1)
        return [base + k for k in range(max(r["max_tokens"] for r in batch))]

    times = child.measure(reqs, child.group_by_adapter(reqs), run_batch)
    assert seen == [(0, [2, 1]), (1, [3])]
    assert times == [[10.0, 11.0], [20.0, 21.0, 22.0], [10.0]]


def test_export_name_follows_the_adapters_files(tmp_path):
    adapter = tmp_path / "a3"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 16}')
    (adapter / "adapter_model.safetensors").write_bytes(b"weights-1")
    first = child.export_name(str(adapter))
    assert first.startswith("merged-a3-") and first == child.export_name(str(adapter))
    (adapter / "adapter_model.safetensors").write_bytes(b"weights-2")
    assert child.export_name(str(adapter)) not in (first, child.BASE)
    assert child.export_name(None) == "base"


def test_rope_theta_is_read_from_transformers5_configs():
    v5 = {"rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}
    assert child.rope_overrides(v5) == {"rope_theta": 100000.0}
    scaled = {"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}}
    assert child.rope_overrides(scaled) == {
        "rope_theta": 5e5,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
    }
    assert child.rope_overrides({"rope_theta": 1e4}) == {}


def test_job_and_env_of_the_child(tmp_path, monkeypatch):
    hf = tmp_path / "smollm2" / "hf"
    reqs = (BenchRequest((7, 8), 4, 1), BenchRequest((9,), 2, None, 0.5))
    workload = Workload("w", reqs, num_adapters=2)
    spec = RunSpec(
        "optimum",
        "Optimum",
        "systems",
        workload.to_json(),
        {"hf": str(hf)},
        adapters=["a0", "a1", "a2"],
        threads=3,
    )
    job = optimum_peer.build_job(spec, workload)
    assert job["adapters"] == ["a0", "a1"] and job["threads"] == 3
    assert Path(job["export_dir"]) == tmp_path / "smollm2" / "optimum_exports"
    assert [(r["adapter"], r["arrival_s"]) for r in job["requests"]] == [(1, 0.0), (None, 0.5)]
    monkeypatch.setenv("PYTHONPATH", "/somewhere")
    env = optimum_peer.optimum_env(3)
    assert "PYTHONPATH" not in env and env["OMP_NUM_THREADS"] == "3"
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"


def test_the_bench_knows_the_system():
    rows = [(label, pattern) for s, label, pattern in plan.SYSTEM_ROWS if s == "optimum"]
    assert rows == [("Optimum base", "base"), ("Optimum merged per adapter (grouped)", "uniform")]
    assert plan.PEER_SYSTEMS["optimum"] == "optimum"
    assert RUNNERS["optimum"] == "ort_lora.bench.systems.optimum_peer"
    assert "torch==2.13.0" in peers.PEERS["optimum"].requirements
    runs = plan.experiments(plan.QUICK, 256, {"optimum"})
    assert [(r["experiment"], r["workload"].num_adapters) for r in runs] == [
        ("systems/decode-heavy", 0),
        ("systems/decode-heavy", plan.QUICK.num_adapters),
        ("systems/prefill-heavy", 0),
        ("systems/prefill-heavy", plan.QUICK.num_adapters),
    ]
