"""The profile summary's pieces (ort_lora/bench/profile.py) on a synthetic ORT trace."""

from __future__ import annotations

import pytest

from ort_lora.bench.profile import node_calls, op_times


def event(name: str, op: str, dur: int, cat: str = "Node") -> dict:
    return {"cat": cat, "name": name, "dur": dur, "args": {"op_name": op}}


TRACE = [
    event("/model/layers.0/self_attn/q_proj+k_proj+v_proj/LoraSGMV_kernel_time", "LoraSGMV", 100),
    event("/model/layers.1/self_attn/q_proj+k_proj+v_proj/LoraSGMV_kernel_time", "LoraSGMV", 140),
    event("/model/layers.12/self_attn/q_proj+k_proj+v_proj/LoraSGMV_kernel_time", "LoraSGMV", 90),
    event("/model/layers.0/mlp/down_proj/LoraSGMV_kernel_time", "LoraSGMV", 50),
    event("/model/layers.0/mlp/down_proj/LoraSGMV_fence_before", "LoraSGMV", 7),
    event("/model/layers.0/mlp/down_proj/MatMul_kernel_time", "MatMul", 300),
    event("model_run", "", 1000, cat="Session"),
]


def test_node_calls_folds_layers_into_one_row_per_node():
    calls = node_calls(TRACE, "LoraSGMV")
    assert calls == {
        "/model/layers.*/mlp/down_proj/LoraSGMV": {"calls": 1, "median_us": 50, "mean_us": 50},
        "/model/layers.*/self_attn/q_proj+k_proj+v_proj/LoraSGMV": {
            "calls": 3,
            "median_us": 100,
            "mean_us": 110,
        },
    }


def test_op_times_counts_kernel_events_only():
    assert op_times(TRACE) == pytest.approx({"MatMul": 300e-6, "LoraSGMV": 380e-6})
