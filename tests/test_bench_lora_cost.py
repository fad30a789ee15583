"""bench/bench_lora_cost.py's harness: the requests it serves, the order of its rounds and the
ratios it reports (the numbers themselves are the benchmark's, never checked here)."""

from __future__ import annotations

from pathlib import Path

import pytest
from script_module import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_lora_cost.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT)


class FakeEngine:
    """Takes requests and finishes them all in one step."""

    def __init__(self):
        self.added, self.pending = [], 0

    def add_request(self, request_id, prompt, params, lora):
        self.added.append((request_id, prompt, params, lora))
        self.pending += 1

    def has_unfinished_requests(self):
        return self.pending > 0

    def step(self):
        self.pending = 0


def test_requests_go_to_adapter_i_mod_16_decode_heavy(bench):
    eng, loras = FakeEngine(), [f"lora{i}" for i in range(16)]
    bench.submit(eng, loras, "t")
    assert [a[3] for a in eng.added] == [f"lora{i % 16}" for i in range(32)]
    assert {len(a[1]) for a in eng.added} == {8}
    params = eng.added[0][2]
    assert (params.max_tokens, params.ignore_eos, params.temperature) == (64, True, 0.0)
    assert len({a[0] for a in eng.added}) == 32  # ids unique within a round


class StepsEngine(FakeEngine):
    """Needs `steps` steps to finish; records them in a shared log."""

    def __init__(self, name, steps, log):
        super().__init__()
        self.name, self.steps, self.log = name, steps, log

    def has_unfinished_requests(self):
        return self.steps > 0

    def step(self):
        self.log.append(self.name)
        self.steps -= 1


def test_the_two_engines_step_in_turn_one_with_adapters_one_without(bench):
    log = []
    mixed, base = StepsEngine("m", 3, log), StepsEngine("b", 2, log)
    rates = bench.serve_in_turn(mixed, base, [f"l{i}" for i in range(16)], "r")
    assert log == ["m", "b", "m", "b", "m"]
    assert all(rate > 0 for rate in rates)
    assert [a[3] for a in base.added] == [None] * 32
    assert [a[3] for a in mixed.added][:2] == ["l0", "l1"]


def test_rounds_and_ratios(bench, monkeypatch):
    calls, speeds = [], {"x-0": (60.0, 100.0), "x-1": (45.0, 50.0), "x-2": (80.0, 100.0)}

    def serve_in_turn(mixed, base, loras, tag):
        calls.append(tag)
        return speeds.get(tag, (1.0, 1.0))

    monkeypatch.setattr(bench, "serve_in_turn", serve_in_turn)
    runs = bench.measure({"x": (FakeEngine(), FakeEngine(), ["l"])}, rounds=3)
    assert calls == ["warm-x", "x-0", "x-1", "x-2"]
    assert runs["x"]["ratio"] == pytest.approx([0.6, 0.9, 0.8])
    assert runs["x"]["median_ratio"] == pytest.approx(0.8)
    doc = {"cpu": "c", "isa": "AVX2", "threads": 2, "adapter_dtype": "int8", "exports": runs}
    assert "0.800" in bench.report(doc)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--exports", "fp8"], "--exports"),
        (["--rounds", "0"], "--rounds"),
        (["--saved", "float8"], "--saved"),
        (["--saved", "float16,float16"], "--saved"),
    ],
)
def test_bad_arguments_name_the_option(bench, argv, says, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err
