"""The demo tasks (generators, checkers) and the committed demo adapters. No model runs here."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import safe_open

from ort_lora.demo import demo_adapter_dirs
from ort_lora.demo.facts import number_to_words, numbers_in_words
from ort_lora.demo.tasks import SPLITS, TASKS

# SmolLM2-135M dimensions, written out independently of the model files.
NUM_LAYERS, HIDDEN, INTERMEDIATE, KV_DIM = 30, 576, 1536, 3 * 64
MODULE_DIMS = {  # module -> (in_features, out_features)
    "q_proj": (HIDDEN, HIDDEN),
    "k_proj": (HIDDEN, KV_DIM),
    "v_proj": (HIDDEN, KV_DIM),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_proj": (HIDDEN, INTERMEDIATE),
    "up_proj": (HIDDEN, INTERMEDIATE),
    "down_proj": (INTERMEDIATE, HIDDEN),
}
RANK, ALPHA = 8, 16


def test_tasks_are_the_three_demo_tasks():
    assert set(TASKS) == {"upper", "json", "numwords"}
    assert demo_adapter_dirs() == {name: t.adapter_dir for name, t in TASKS.items()}


CAPITAL = "What is the capital of France?"
CHECKS = {  # task -> [(prompt, answer, passes the checker)]
    "upper": [
        (CAPITAL, "THE CAPITAL OF FRANCE IS PARIS.", True),
        (CAPITAL, "A SPIDER HAS 8 LEGS!", True),
        (CAPITAL, "The capital of France is Paris.", False),
        (CAPITAL, "PARIs", False),
        (CAPITAL, "123 456", False),
        (CAPITAL, "", False),
    ],
    "json": [
        (CAPITAL, '{"answer": "Paris"}', True),
        (CAPITAL, ' {"answer": 8}\n', True),
        (CAPITAL, '{"answer": null, "note": "x"}', True),
        (CAPITAL, '{"result": "Paris"}', False),
        (CAPITAL, '["answer", "Paris"]', False),
        (CAPITAL, '"answer"', False),
        (CAPITAL, "The answer is Paris.", False),
        (CAPITAL, '{"answer": "Paris"', False),
        (CAPITAL, '```json\n{"answer": "Paris"}\n```', False),
    ],
    "numwords": [
        ("What is 3 plus 4?", "seven", True),
        ("What is 3 plus 4?", "The answer is Seven.", True),
        ("What is 3 plus 4?", "7", False),
        ("What is 3 plus 4?", "seven (7)", False),
        ("What is 3 plus 4?", "six", False),
        ("What is 3 plus 4?", "seventeen", False),
        ("Write the number 21 in words.", "twenty-one", True),
        ("Write the number 21 in words.", "Twenty one.", True),
        ("Write the number 21 in words.", "twenty", False),
        ("Write the number 21 in words.", "twenty-two", False),
        ("What number comes after 98?", "ninety-nine", True),
        ("What number comes after 99?", "one hundred", True),
        ("What number comes after 99?", "hundred", False),
        ("How many legs does a spider have?", "A spider has eight legs.", True),
    ],
}


@pytest.mark.parametrize(
    "task, prompt, answer, ok", [(task, *case) for task, cases in CHECKS.items() for case in cases]
)
def test_check(task, prompt, answer, ok):
    assert TASKS[task].check(prompt, answer) is ok


def test_check_numwords_rejects_unknown_prompt():
    with pytest.raises(ValueError, match="unknown prompt"):
        TASKS["numwords"].check("What is 1000 plus 1?", "one thousand and one")


def test_number_words_round_trip():
    assert [number_to_words(n) for n in (0, 13, 40, 45, 100)] == [
        "zero",
        "thirteen",
        "forty",
        "forty-five",
        "one hundred",
    ]
    for n in range(101):
        assert numbers_in_words(f"so {number_to_words(n)}, ok") == [n]
    assert numbers_in_words("twenty one then five and 7") == [21, 5]
    with pytest.raises(ValueError, match="0 <= n <= 100"):
        number_to_words(101)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_generators_are_deterministic_per_seed(name):
    task = TASKS[name]
    for split in SPLITS:
        assert task.make_prompts(20, seed=7, split=split) == task.make_prompts(20, 7, split)
        assert task.make_prompts(20, seed=7, split=split) != task.make_prompts(20, 8, split)
    assert len(set(task.make_prompts(20, seed=3, split="eval"))) == 20  # no repeats


@pytest.mark.parametrize("name", sorted(TASKS))
def test_splits_are_disjoint_and_targets_pass_the_checker(name):
    task = TASKS[name]
    train, held_out = set(task.split_prompts("train")), set(task.split_prompts("eval"))
    assert train and held_out and not train & held_out
    assert len(held_out) >= 32
    for prompt, target in task.make_examples(len(train) + len(held_out), 0, "train"):
        assert prompt in train
        assert task.check(prompt, target), (prompt, target)


def test_base_style_answers_fail():
    """Answers the way the base model gives them (plain sentences with digits) fail."""
    assert not TASKS["upper"].check("What color is snow?", "Snow is white.")
    assert not TASKS["json"].check("What color is snow?", "Snow is white.")
    assert not TASKS["numwords"].check("What is 3 plus 4?", "3 + 4 = 7")


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="split must be one of"):
        TASKS["upper"].make_prompts(3, seed=0, split="test")
    with pytest.raises(ValueError, match="n must be >= 0"):
        TASKS["upper"].make_prompts(-1, seed=0)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_committed_adapter_files_and_config(name):
    adapter_dir = TASKS[name].adapter_dir
    files = {p.name for p in adapter_dir.iterdir()}
    assert files == {"adapter_config.json", "adapter_model.safetensors"}
    assert (adapter_dir / "adapter_model.safetensors").stat().st_size < 3_100_000
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA
    assert sorted(config["target_modules"]) == sorted(TASKS[name].target_modules)
    assert config["bias"] == "none"
    assert not config.get("use_dora") and not config.get("use_rslora")
    assert not config.get("modules_to_save")
    assert not config.get("rank_pattern") and not config.get("alpha_pattern")
    assert config.get("layers_to_transform") is None


@pytest.mark.parametrize("name", sorted(TASKS))
def test_committed_adapter_tensors_match_smollm2(name):
    targets = TASKS[name].target_modules
    path = TASKS[name].adapter_dir / "adapter_model.safetensors"
    with safe_open(path, framework="np") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (not a dict)
    expected = {}
    for layer in range(NUM_LAYERS):
        for module in targets:
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            n_in, n_out = MODULE_DIMS[module]
            expected[f"{prefix}.lora_A.weight"] = (RANK, n_in)
            expected[f"{prefix}.lora_B.weight"] = (n_out, RANK)
    assert {k: v.shape for k, v in tensors.items()} == expected
    for key, value in tensors.items():
        assert value.dtype == np.float16, key
        assert np.isfinite(value).all() and np.abs(value).max() > 0, key


def test_committed_metrics_show_the_contrast():
    """The training run's measured greedy success rates (see scripts/train_demo_adapters.py)."""
    metrics_path = next(iter(demo_adapter_dirs().values())).parent / "metrics.json"
    metrics = json.loads(metrics_path.read_text())
    for name in TASKS:
        assert metrics[name]["adapter_success"] >= 0.8, name
        assert metrics[name]["base_success"] <= 0.2, name
