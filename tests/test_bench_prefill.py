"""bench/bench_prefill.py's harness: the prompts it serves and the medians and ratios it reports
(the numbers themselves are the benchmark's, never checked here)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from script_module import assert_usage_error, load_script

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "bench_prefill.py"


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT)


class Engine:
    """Serves one request at a time: a step per `chunk` prompt tokens, then it is done (one new
    token, as with max_tokens 1)."""

    def __init__(self, name, log, chunk=2048):
        self.name, self.log, self.chunk = name, log, chunk
        self.added, self.left = [], 0
        self.times = SimpleNamespace(num_tokens=0, num_seqs=0)

    def add_request(self, request_id, prompt, params, lora=None):
        assert self.left == 0, "a request added while another was running"
        self.added.append((request_id, prompt, params, lora))
        self.left = -(-len(prompt) // self.chunk)

    def has_unfinished_requests(self):
        return self.left > 0

    def step(self):
        self.log.append(self.name)
        self.left -= 1
        return []


def test_every_round_prefills_new_prompts_the_same_on_every_engine(bench):
    log = []
    engines = {"this": Engine("this", log), "other": Engine("other", log)}
    first = bench.one_round(engines, [500, 3000], 0)
    second = bench.one_round(engines, [500, 3000], 1)
    assert log[:2] == ["this", "other"]  # steps in turn
    assert log.count("this") == log.count("other") == 2 * (1 + 2)  # 3000 tokens: two steps
    for eng in engines.values():
        prompts = [a[1] for a in eng.added]
        assert [len(x) for x in prompts] == [500, 3000, 500, 3000]
        assert len({tuple(x) for x in prompts}) == 4  # no prompt repeats: no prefix-cache hit
        assert all(a[3] is None for a in eng.added)
        params = eng.added[0][2]
        assert (params.max_tokens, params.ignore_eos, params.temperature) == (1, True, 0.0)
    assert [a[1] for a in engines["this"].added] == [a[1] for a in engines["other"].added]
    for times in (first, second):
        assert set(times) == {"this", "other"}
        assert all(set(t) == {500, 3000} and min(t.values()) > 0 for t in times.values())
    ids = [a[0] for eng in engines.values() for a in eng.added]
    assert len(set(ids)) == len(ids)


def test_an_adapter_goes_with_every_prompt_on_every_engine(bench):
    log = []
    engines = {"this": Engine("this", log), "other": Engine("other", log)}
    bench.one_round(engines, [100, 200], 0, lora="upper-request")
    bench.first_tokens(engines, [1, 2, 3], "warm", "upper-request")
    for eng in engines.values():
        assert [a[3] for a in eng.added] == ["upper-request"] * 3


def test_a_server_gets_the_round_s_prompts_after_the_engines(bench):
    log, seen = [], []

    def first_token(prompt):
        log.append("server")
        seen.append(prompt)
        return 0.5

    engines = {"this": Engine("this", log)}
    times = bench.one_round(engines, [100, 200], 2, {"llama.cpp": first_token})
    assert log == ["this", "server", "this", "server"]
    assert seen == [a[1] for a in engines["this"].added]
    assert times["llama.cpp"] == {100: 0.5, 200: 0.5} and set(times["this"]) == {100, 200}


def test_summary_medians_rates_and_ratios(bench):
    ttft = {"this": {1000: [2.0, 1.0, 4.0]}, "other": {1000: [3.0, 1.5, 4.0]},
            "llama.cpp": {1000: [8.0, 8.0, 8.0]}}  # fmt: skip
    doc = bench.summary(ttft, [1000])
    assert doc["median_ttft_s"] == {"this": {1000: 2.0}, "other": {1000: 3.0},
                                    "llama.cpp": {1000: 8.0}}  # fmt: skip
    assert doc["over_this"]["llama.cpp"][1000]["rounds"] == pytest.approx([4.0, 8.0, 2.0])
    assert doc["prefill_tok_s"]["this"][1000] == pytest.approx(500.0)
    ratio = doc["over_this"]["other"][1000]
    assert ratio["rounds"] == pytest.approx([1.5, 1.5, 1.0]) and ratio["median"] == 1.5
    assert bench.summary({"this": ttft["this"]}, [1000])["over_this"] == {}


def test_prompts_are_seeded_token_ids_of_the_length_asked(bench):
    assert len(bench.prompt_ids(2000, 1)) == 2000
    assert bench.prompt_ids(8, 3) == bench.prompt_ids(8, 3) != bench.prompt_ids(8, 4)
    assert all(100 <= t < bench.VOCAB for t in bench.prompt_ids(500, 5))


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--rounds", "0"], "--rounds"),
        (["--prompts", "0"], "--prompts"),
        (["--prompts", "500,x"], "--prompts"),
        (["--prompts", "9000"], "--prompts"),
        (["--against-library", "/no/such/lib.so"], "--against-library"),
        (["--adapter", "nosuch"], "--adapter"),
        (["--adapter", "upper", "--llama-cpp"], "--adapter"),
    ],
)
def test_bad_arguments_name_the_option(bench, argv, says, capsys):
    assert_usage_error(bench.main, argv, says, capsys)
