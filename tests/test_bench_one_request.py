"""bench/bench_one_request.py's harness: the requests it serves, one at a time, and the ratios
it reports (the numbers themselves are the benchmark's, never checked here)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from script_module import assert_usage_error, load_script

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_one_request.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT)


class Engine:
    """Finishes its one request in `steps` steps, the first its prompt's (LLMEngine.times as
    the engine sets them); refuses a second request while one runs."""

    def __init__(self, name, steps, log):
        self.name, self.steps, self.log = name, steps, log
        self.added, self.left = [], 0
        self.times = SimpleNamespace(num_tokens=0, num_seqs=0)

    def add_request(self, request_id, prompt, params, lora):
        assert self.left == 0, "a request added while another was running"
        self.added.append((request_id, prompt, params, lora))
        self.left = self.steps

    def has_unfinished_requests(self):
        return self.left > 0

    def step(self):
        self.log.append(self.name)
        prompt = self.left == self.steps
        self.times.num_tokens, self.times.num_seqs = len(self.added[-1][1]) if prompt else 1, 1
        if prompt:
            time.sleep(0.01)  # a prompt's step is the slow one
        self.left -= 1
        return []


def test_one_request_at_a_time_the_adapter_on_adapter_roles_only(bench):
    log = []
    engines = {role: Engine(role, 2, log)
               for role in ("base", "adapter", "other base", "other adapter")}  # fmt: skip
    prompt = bench.prompt_ids(8)
    rates, decode_ms = bench.one_at_a_time(engines, "upper", "t", prompt)
    assert log[:4] == ["base", "adapter", "other base", "other adapter"]  # steps in turn
    assert len(log) == 4 * 2 * bench.REQUESTS
    for role, eng in engines.items():
        assert len(eng.added) == bench.REQUESTS and rates[role] > 0
        want = "upper" if role.endswith("adapter") else None
        assert [a[3] for a in eng.added] == [want] * bench.REQUESTS
        assert all(a[1] == prompt for a in eng.added)
        assert 0 < decode_ms[role] < 2  # the prompts' 10 ms steps are not decode steps
        params = eng.added[0][2]
        assert (params.max_tokens, params.ignore_eos, params.temperature) == (64, True, 0.0)
    ids = [a[0] for eng in engines.values() for a in eng.added]
    assert len(set(ids)) == len(ids)


def test_prompts_are_seeded_token_ids_of_the_length_asked(bench):
    assert len(bench.prompt_ids(2000)) == 2000 and bench.prompt_ids(8) == bench.prompt_ids(8)
    assert all(100 <= t < bench.VOCAB for t in bench.prompt_ids(500))


def test_ratios_per_round_and_median(bench):
    rates = {"adapter": [80.0, 45.0, 60.0], "base": [100.0, 50.0, 100.0]}
    r = bench.ratios(rates, "adapter", "base")
    assert r["rounds"] == pytest.approx([0.8, 0.9, 0.6]) and r["median"] == pytest.approx(0.8)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--rounds", "0"], "--rounds"),
        (["--adapter", "nope"], "--adapter"),
        (["--prompt", "0"], "--prompt"),
        (["--against-library", "/no/such/lib.so"], "--against-library"),
    ],
)
def test_bad_arguments_name_the_option(bench, argv, says, capsys):
    assert_usage_error(bench.main, argv, says, capsys)
