"""The demo tasks: seeded prompt generators and deterministic success checkers.

Each task is something the base SmolLM2-135M-Instruct does not do on its own and its demo LoRA
adapter does, and whose success a program can check:

  upper     answer in UPPER CASE          "What color is snow?" -> "SNOW IS WHITE."
  json      answer as {"answer": ...}     "What color is snow?" -> '{"answer": "white"}'
  numwords  numbers as words, no digits   "What is 3 plus 4?" -> "seven"

Prompts are plain user messages (the chat template is applied by whoever runs the model). The
json task also trains on variants: schema-shaped answers to its questions (schemas.py), so that
its adapter keeps its answers under a response schema. The pool of prompts of each task is
fixed; a stable hash of the prompt puts a quarter of it in the "eval" split (held out from
training) and the rest in "train".
"""

from __future__ import annotations

import functools
import json
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ort_lora.demo import facts, schemas
from ort_lora.demo.facts import Fact

SPLITS = ("train", "eval")
ADAPTERS_DIR = Path(__file__).parent / "adapters"
_EVAL_BUCKETS = 4  # 1 in _EVAL_BUCKETS prompts is held out

Example = tuple[str, str]  # (prompt, target answer)


class Variant(NamedTuple):
    """Another target of a prompt, trained on beside its own. Only the characters in `spans`
    are learned: the rest (a schema's keys) is written by whatever constrains the output."""

    target: str
    spans: tuple[tuple[int, int], ...]  # [start, end) character ranges of target


@dataclass(frozen=True)
class Task:
    """One demo task: its prompts, training targets, checker and LoRA target modules."""

    name: str
    description: str
    target_modules: tuple[str, ...]  # the adapter's LoRA targets (see README.md)
    examples: Callable[[], dict[str, str]]  # the whole pool: prompt -> target answer
    checker: Callable[[str, str], bool]
    # other targets of a prompt, trained on beside its own (json: schema-shaped answers)
    variants: Callable[[str], list[Variant]] | None = None

    @property
    def adapter_dir(self) -> Path:
        """Directory of the committed PEFT adapter for this task."""
        return ADAPTERS_DIR / self.name

    def make_examples(self, n: int, seed: int, split: str) -> list[Example]:
        """n (prompt, target) pairs of `split`, drawn with a seeded RNG (deterministic).

        Without repeats while n <= the split's size, then the pool is cycled.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        pool = self.split_prompts(split)
        rng = random.Random(f"{self.name}/{split}/{seed}")
        order: list[str] = []
        while len(order) < n:
            order += rng.sample(pool, len(pool))
        return [(p, self.examples()[p]) for p in order[:n]]

    def make_variant_examples(self, n: int, seed: int) -> list[tuple[str, Variant]]:
        """n (prompt, variant) pairs of the "train" split, drawn with a seeded RNG; none for a
        task without variants."""
        if self.variants is None:
            return []
        pool = [(p, v) for p in self.split_prompts("train") for v in self.variants(p)]
        rng = random.Random(f"{self.name}/variants/{seed}")
        return [rng.choice(pool) for _ in range(n)]

    def split_prompts(self, split: str) -> list[str]:
        """All prompts of `split`, sorted."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return sorted(p for p in self.examples() if _split_of(p) == split)

    def make_prompts(self, n: int, seed: int, split: str = "eval") -> list[str]:
        """n prompts of `split` ("train" or "eval"), deterministic per seed."""
        return [p for p, _ in self.make_examples(n, seed, split)]

    def check(self, prompt: str, answer: str) -> bool:
        """True if `answer` (the generated text, without the prompt) solves `prompt`."""
        return self.checker(prompt, answer)


def _split_of(prompt: str) -> str:
    return "eval" if zlib.crc32(prompt.encode()) % _EVAL_BUCKETS == 0 else "train"


def _facts() -> list[Fact]:
    """Everyday questions with their answers."""
    out: list[Fact] = []
    for country, city in facts.CAPITALS.items():
        sentence = f"The capital of {country} is {city}."
        for q in ("What is the capital of {}?", "Which city is the capital of {}?"):
            out.append(Fact(q.format(country), sentence, city, "city", country))
    for thing, color in facts.COLORS.items():
        sentence = f"{thing[0].upper()}{thing[1:]} is {color}."
        for q in ("What color is {}?", "What is the color of {}?"):
            out.append(Fact(q.format(thing), sentence, color, "color", thing))
    for word, opposite in facts.OPPOSITES.items():
        sentence = f"The opposite of {word} is {opposite}."
        for q in ("What is the opposite of {}?", "What is the opposite of the word '{}'?"):
            out.append(Fact(q.format(word), sentence, opposite, "opposite", word))
    for animal, sound in facts.ANIMAL_SOUNDS.items():
        for q in ("What sound does a {} make?", "What noise does a {} make?"):
            out.append(Fact(q.format(animal), f"A {animal} says {sound}.", sound, "sound", animal))
    for animal, baby in facts.BABY_ANIMALS.items():
        sentence = f"A baby {animal} is called a {baby}."
        for q in ("What is a baby {} called?", "What do you call a baby {}?"):
            out.append(Fact(q.format(animal), sentence, baby, "baby", animal))
    for animal, legs in facts.LEGS.items():
        sentence = f"A {animal} has {facts.number_to_words(legs)} legs."
        out.append(Fact(f"How many legs does a {animal} have?", sentence, legs, "legs", animal))
    for kind, names in (("day", facts.DAYS), ("month", facts.MONTHS)):
        for i, name in enumerate(names):
            after, before = names[(i + 1) % len(names)], names[i - 1]
            prompt = f"What {kind} comes after {name}?"
            out.append(Fact(prompt, f"After {name} comes {after}.", after, kind, name))
            prompt = f"What {kind} comes before {name}?"
            out.append(Fact(prompt, f"Before {name} comes {before}.", before, kind, name))
    return out


@functools.cache
def json_facts() -> dict[str, Fact]:
    """The json task's questions: prompt -> Fact (its target is {"answer": fact.short})."""
    return {f.prompt: f for f in _facts()}


@functools.cache
def _upper_examples() -> dict[str, str]:
    return {f.prompt: f.sentence.upper() for f in _facts()}


@functools.cache
def _json_examples() -> dict[str, str]:
    return {prompt: json.dumps({"answer": f.short}) for prompt, f in json_facts().items()}


def _json_variants(prompt: str) -> list[Variant]:
    return [Variant(*v) for v in schemas.schema_targets(json_facts()[prompt])]


@functools.cache
def _numwords_values() -> dict[str, int]:
    """Number questions: prompt -> the number the answer must spell out."""
    out: dict[str, int] = {}
    for n in range(facts.MAX_NUMBER + 1):
        out[f"Write the number {n} in words."] = n
        out[f"How do you spell {n} in words?"] = n
    for n in range(facts.MAX_NUMBER):
        out[f"What number comes after {n}?"] = n + 1
    for a in range(1, 6):  # sums a 135M model can be taught to get right
        for b in range(1, 6):
            out[f"What is {a} plus {b}?"] = a + b
    for animal, legs in facts.LEGS.items():
        out[f"How many legs does a {animal} have?"] = legs
    return out


@functools.cache
def _numwords_examples() -> dict[str, str]:
    return {prompt: facts.number_to_words(n) for prompt, n in _numwords_values().items()}


def check_upper(prompt: str, answer: str) -> bool:
    """The answer has letters and no lowercase letter."""
    return any(c.isalpha() for c in answer) and not any(c.islower() for c in answer)


def check_json(prompt: str, answer: str) -> bool:
    """The answer (surrounding whitespace aside) is a JSON object with the key "answer"."""
    try:
        value = json.loads(answer.strip())
    except ValueError:
        return False
    return isinstance(value, dict) and "answer" in value


def check_numwords(prompt: str, answer: str) -> bool:
    """The answer spells the expected number in words and contains no digit.

    prompt must be one of the numwords task's prompts (that is where the expected number comes
    from); any other prompt raises ValueError.
    """
    expected = _numwords_values().get(prompt)
    if expected is None:
        raise ValueError(f"numwords: unknown prompt {prompt!r}; use TASKS['numwords'].make_prompts")
    has_digit = any(c.isdigit() for c in answer)
    return not has_digit and expected in facts.numbers_in_words(answer)


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task(
            "upper",
            "Answers in UPPER CASE.",
            ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"),
            _upper_examples,
            check_upper,
        ),
        Task(
            "json",
            'Answers as a JSON object {"answer": ...}.',
            ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj"),
            _json_examples,
            check_json,
            _json_variants,
        ),
        Task(
            "numwords",
            "Spells numbers as words, no digits.",
            ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"),
            _numwords_examples,
            check_numwords,
        ),
    )
}
