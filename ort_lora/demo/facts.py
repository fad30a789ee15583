"""Everyday facts and number words the demo tasks build their prompts and targets from.

Pure data plus two pure functions; the tasks (tasks.py) turn these into (prompt, target) pairs.
"""

from __future__ import annotations

import re
from typing import NamedTuple


class Fact(NamedTuple):
    """An everyday question and its answers."""

    prompt: str
    sentence: str  # the answer as a sentence (the upper task's, before upper-casing)
    short: str | int  # the answer alone (the json task's)
    kind: str  # what the short answer is: city, color, opposite, sound, baby, legs, day, month
    subject: str  # what the question is about: the country, thing, word, animal, day, month


CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Japan": "Tokyo",
    "China": "Beijing",
    "Russia": "Moscow",
    "Egypt": "Cairo",
    "Greece": "Athens",
    "Norway": "Oslo",
    "Sweden": "Stockholm",
    "Finland": "Helsinki",
    "Poland": "Warsaw",
    "Austria": "Vienna",
    "Portugal": "Lisbon",
    "Ireland": "Dublin",
    "Canada": "Ottawa",
    "Mexico": "Mexico City",
    "Peru": "Lima",
    "Kenya": "Nairobi",
    "Thailand": "Bangkok",
    "Belgium": "Brussels",
    "Hungary": "Budapest",
    "Denmark": "Copenhagen",
    "Argentina": "Buenos Aires",
    "Cuba": "Havana",
    "Iran": "Tehran",
    "Chile": "Santiago",
}

COLORS = {
    "a banana": "yellow",
    "grass": "green",
    "the sky on a clear day": "blue",
    "snow": "white",
    "coal": "black",
    "a ripe tomato": "red",
    "an orange": "orange",
    "a lemon": "yellow",
    "a strawberry": "red",
    "milk": "white",
    "a lime": "green",
    "a carrot": "orange",
    "a blueberry": "blue",
    "chocolate": "brown",
    "a plum": "purple",
    "a crow": "black",
    "a fire truck": "red",
    "a polar bear": "white",
    "a frog": "green",
    "an eggplant": "purple",
}

OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "fast": "slow",
    "up": "down",
    "happy": "sad",
    "light": "dark",
    "old": "young",
    "open": "closed",
    "early": "late",
    "full": "empty",
    "tall": "short",
    "wet": "dry",
    "strong": "weak",
    "loud": "quiet",
    "rich": "poor",
    "hard": "soft",
    "thick": "thin",
    "near": "far",
    "clean": "dirty",
    "heavy": "light",
    "cheap": "expensive",
    "right": "wrong",
    "day": "night",
    "inside": "outside",
}

ANIMAL_SOUNDS = {
    "dog": "bark",
    "cat": "meow",
    "cow": "moo",
    "duck": "quack",
    "sheep": "baa",
    "lion": "roar",
    "pig": "oink",
    "horse": "neigh",
    "owl": "hoot",
    "snake": "hiss",
    "frog": "croak",
    "bee": "buzz",
    "mouse": "squeak",
    "wolf": "howl",
}

BABY_ANIMALS = {
    "dog": "puppy",
    "cat": "kitten",
    "cow": "calf",
    "sheep": "lamb",
    "horse": "foal",
    "goat": "kid",
    "duck": "duckling",
    "frog": "tadpole",
    "bear": "cub",
    "kangaroo": "joey",
    "swan": "cygnet",
    "deer": "fawn",
}

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]

MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]

LEGS = {
    "dog": 4,
    "cat": 4,
    "spider": 8,
    "bird": 2,
    "ant": 6,
    "horse": 4,
    "chicken": 2,
    "bee": 6,
    "cow": 4,
    "duck": 2,
    "octopus": 8,
    "beetle": 6,
}

_UNITS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
]
_TENS = ["_", "_", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
MAX_NUMBER = 100


def number_to_words(n: int) -> str:
    """English words for 0 <= n <= 100, e.g. 21 -> "twenty-one", 100 -> "one hundred"."""
    if not 0 <= n <= MAX_NUMBER:
        raise ValueError(f"number_to_words: expected 0 <= n <= {MAX_NUMBER}, got {n}")
    if n == MAX_NUMBER:
        return "one hundred"
    if n < 20:
        return _UNITS[n]
    tens, unit = divmod(n, 10)
    return _TENS[tens] if unit == 0 else f"{_TENS[tens]}-{_UNITS[unit]}"


def numbers_in_words(text: str) -> list[int]:
    """Every number written in words in text, e.g. "twenty one, then 7 and five" -> [21, 5].

    Adjacent number words combine ("twenty-one", "twenty one", "one hundred"); digits are ignored.
    """
    values: list[int] = []
    current: int | None = None
    for word in re.findall(r"[a-z]+", text.lower()):
        extended = _extend(current, word)
        if extended is not None:
            current = extended
            continue
        if current is not None:
            values.append(current)
        current = _extend(None, word)  # a number word starts a new phrase, others give None
    if current is not None:
        values.append(current)
    return values


def _extend(current: int | None, word: str) -> int | None:
    """The value of the number phrase `current` followed by `word`, or None if it cannot extend."""
    if word in _UNITS:
        unit = _UNITS.index(word)
        if current is None:
            return unit
        return current + unit if current >= 20 and current % 10 == 0 and 0 < unit < 10 else None
    if word in _TENS[2:]:
        return 10 * _TENS.index(word) if current is None else None
    if word == "hundred":
        return 100 * current if current is not None and 0 < current < 10 else None
    return None
