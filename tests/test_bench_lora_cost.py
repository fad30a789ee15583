"""bench/bench_lora_cost.py's harness: the requests it serves, the order of its rounds and the
ratios it reports (the numbers themselves are the benchmark's, never checked here)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from script_module import assert_usage_error, load_script

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

    def step(self):  # LLMEngine.step's outputs: none finish here
        self.pending = 0
        return []


def test_requests_go_to_adapter_i_mod_16_decode_heavy(bench):
    eng, loras = FakeEngine(), [f"lora{i}" for i in range(16)]
    bench.submit(eng, loras, "t")
    assert [a[3] for a in eng.added] == [f"lora{i % 16}" for i in range(32)]
    assert {len(a[1]) for a in eng.added} == {8}
    params = eng.added[0][2]
    assert (params.max_tokens, params.ignore_eos, params.temperature) == (64, True, 0.0)
    assert len({a[0] for a in eng.added}) == 32  # ids unique within a round


def test_patterns_put_the_requests_on_popular_adapters(bench):
    loras = [f"lora{i}" for i in range(16)]
    identical, skewed = FakeEngine(), FakeEngine()
    bench.submit(identical, loras, "t", "identical")
    bench.submit(skewed, loras, "t", "skewed")
    assert [a[3] for a in identical.added] == ["lora0"] * 32
    chosen = [a[3] for a in skewed.added]
    assert len(chosen) == 32 and 1 < len(set(chosen)) < 16
    assert max(set(chosen), key=chosen.count) == "lora0"  # Zipf: the first is the most popular
    base = FakeEngine()
    bench.submit(base, None, "t", "identical")  # the base engines: no adapter whatever the pattern
    assert [a[3] for a in base.added] == [None] * 32
    doc = {"cpu": "c", "isa": "AVX2", "threads": 2, "adapter_dtype": "auto", "exports": {}}
    assert "16 adapters mixed / base" in bench.report(doc)
    assert "16 adapters, identical / base" in bench.report(doc | {"pattern": "identical"})


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
        return []


def test_the_engines_step_in_turn_base_without_adapters(bench):
    log = []
    mixed, base = StepsEngine("m", 3, log), StepsEngine("b", 2, log)
    other, other_base = StepsEngine("o", 1, log), StepsEngine("ob", 1, log)
    engines = {"mixed": mixed, "base": base, "other": other, "other base": other_base}
    rates = bench.serve_in_turn(engines, [f"l{i}" for i in range(16)], "r")
    assert log == ["m", "b", "o", "ob", "m", "b", "m"]
    assert set(rates) == set(engines) and all(r > 0 for r in rates.values())
    assert rates["mixed"] < rates["base"] < rates["other"]  # more steps, more time
    assert [a[3] for a in base.added] == [a[3] for a in other_base.added] == [None] * 32
    assert [a[3] for a in mixed.added][:2] == ["l0", "l1"]
    assert [a[3] for a in other.added] == [a[3] for a in mixed.added]


def test_rounds_and_ratios(bench, monkeypatch):
    calls = []
    speeds = {
        "x-0": {"mixed": 60.0, "base": 100.0, "other": 50.0},
        "x-1": {"mixed": 45.0, "base": 50.0, "other": 40.0},
        "x-2": {"mixed": 80.0, "base": 100.0, "other": 70.0},
    }

    def serve_in_turn(engines, loras, tag, pattern):
        calls.append((tag, pattern))
        return speeds.get(tag, dict.fromkeys(engines, 1.0))

    monkeypatch.setattr(bench, "serve_in_turn", serve_in_turn)
    engines = {"mixed": FakeEngine(), "base": FakeEngine(), "other": FakeEngine()}
    runs = bench.measure({"x": (engines, ["l"])}, rounds=3, pattern="skewed")
    assert calls == [(t, "skewed") for t in ("warm-x", "x-0", "x-1", "x-2")]
    assert runs["x"]["ratio"] == pytest.approx([0.6, 0.9, 0.8])
    assert runs["x"]["median_ratio"] == pytest.approx(0.8)
    assert runs["x"]["other_ratio"] == pytest.approx([0.5, 0.8, 0.7])
    assert runs["x"]["median_other_ratio"] == pytest.approx(0.7)
    assert "base_speedup" not in runs["x"]  # no base engine on the other library
    doc = {"cpu": "c", "isa": "AVX2", "threads": 2, "adapter_dtype": "int8", "exports": runs}
    text = bench.report(doc)
    assert "0.800" in text and "other library" in text and "0.700" in text


def test_twins_of_both_engines_give_each_builds_cost_and_the_speedups(bench, monkeypatch):
    speeds = {
        "x-0": {"mixed": 60.0, "base": 100.0, "other": 40.0, "other base": 80.0},
        "x-1": {"mixed": 45.0, "base": 50.0, "other": 30.0, "other base": 40.0},
    }
    monkeypatch.setattr(bench, "serve_in_turn", lambda e, loras, tag, pattern: speeds.get(tag, {}))
    engines = dict.fromkeys(("mixed", "base", "other", "other base"), FakeEngine())
    run = bench.measure({"x": (engines, ["l"])}, rounds=2)["x"]
    assert run["ratio"] == pytest.approx([0.6, 0.9])
    assert run["other_ratio"] == pytest.approx([0.5, 0.75])  # other / other base
    assert run["mixed_speedup"] == pytest.approx([1.5, 1.5])
    assert run["base_speedup"] == pytest.approx([1.25, 1.25])
    doc = {"cpu": "c", "isa": "AVX2", "threads": 2, "adapter_dtype": "auto", "exports": {"x": run}}
    assert "this / other, base" in bench.report(doc) and "1.250" in bench.report(doc)


def test_without_another_library_no_other_ratio(bench, monkeypatch):
    rates = {"mixed": 1.0, "base": 2.0}
    monkeypatch.setattr(bench, "serve_in_turn", lambda e, loras, tag, pattern: rates)
    runs = bench.measure({"x": ({"mixed": FakeEngine(), "base": FakeEngine()}, ["l"])}, rounds=1)
    assert runs["x"]["ratio"] == [0.5] and "other_ratio" not in runs["x"]


def test_engine_on_another_library_restores_the_environment(bench, monkeypatch, tmp_path):
    seen = []

    class Engine:
        def __init__(self, model, config, intra_op_num_threads, seed):
            seen.append(os.environ.get("ORT_LORA_LIBRARY"))

        def add_lora(self, lora):
            pass

    monkeypatch.setattr("ort_lora.engine.llm_engine.LLMEngine", Engine)
    monkeypatch.setenv("ORT_LORA_LIBRARY", "mine.so")
    bench.engine(tmp_path, [], 2, "other.so")
    bench.engine(tmp_path, [], 2)
    assert seen == ["other.so", "mine.so"] and os.environ["ORT_LORA_LIBRARY"] == "mine.so"


def test_scattered_engines_take_one_seeded_order_of_free_pages(bench, monkeypatch, tmp_path):
    from ort_lora.engine.pool import PagePool

    class Engine:
        def __init__(self, model, config, intra_op_num_threads, seed):
            self.pool = PagePool(50)

        def add_lora(self, lora):
            pass

    monkeypatch.setattr("ort_lora.engine.llm_engine.LLMEngine", Engine)
    plain = bench.engine(tmp_path, [], 2)[0].pool.free_pages()
    one, two = (bench.engine(tmp_path, [], 2, scattered=True)[0] for _ in range(2))
    assert plain == list(range(50)) and one.pool.free_pages() != plain
    assert one.pool.free_pages() == two.pool.free_pages()  # twins see the same layout


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--exports", "fp8"], "--exports"),
        (["--rounds", "0"], "--rounds"),
        (["--saved", "float8"], "--saved"),
        (["--saved", "float16,float16"], "--saved"),
        (["--against-library", "/no/such/lib.so"], "--against-library"),
    ],
)
def test_bad_arguments_name_the_option(bench, argv, says, capsys):
    assert_usage_error(bench.main, argv, says, capsys)
