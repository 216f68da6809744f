"""Deterministic generators of the built-in data sets, in GSM8K's format.

Each problem has a ``question`` and an ``answer`` whose last line is ``#### N``, like GSM8K, so
the same recipe and verl's GSM8K reward function handle them. Works offline.

- ``arithmetic``: word problems of two steps (what the built-in model's tokenizer is trained on);
- ``repeat-digit``: ``Repeat: 7`` answered ``#### 7``, the example task
  (``configs/tasks/repeat-digit/``) that the built-in tiny model can learn on one GPU in minutes.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from verl_pipeline.constants import BUILTIN_DATA

_NAMES = ["Ada", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kemal", "Lina"]
_ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cookies", "stamps"]


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str


def _problem(rng: random.Random) -> Problem:
    name = rng.choice(_NAMES)
    item = rng.choice(_ITEMS)
    start = rng.randint(5, 60)
    gained = rng.randint(2, 40)
    kind = rng.randrange(3)
    if kind == 0:
        lost = rng.randint(1, start + gained)
        total = start + gained - lost
        q = (
            f"{name} has {start} {item}. {name} gets {gained} more and then gives away {lost}. "
            f"How many {item} does {name} have now?"
        )
        steps = [f"{start} + {gained} = {start + gained}", f"{start + gained} - {lost} = {total}"]
    elif kind == 1:
        boxes = rng.randint(2, 9)
        total = start + boxes * gained
        q = (
            f"{name} has {start} {item} and buys {boxes} boxes with {gained} {item} in each. "
            f"How many {item} does {name} have in total?"
        )
        steps = [f"{boxes} * {gained} = {boxes * gained}", f"{start} + {boxes * gained} = {total}"]
    else:
        friends = rng.randint(2, 6)
        each = rng.randint(2, 12)
        total = friends * each + start
        q = (
            f"{name} shares {item} with {friends} friends, giving each friend {each}. "
            f"{name} keeps {start}. How many {item} did {name} have at first?"
        )
        steps = [f"{friends} * {each} = {friends * each}", f"{friends * each} + {start} = {total}"]
    answer = "\n".join(steps) + f"\n#### {total}"
    return Problem(question=q, answer=answer)


def _arithmetic(n: int, rng: random.Random) -> Iterator[Problem]:
    for _ in range(n):
        yield _problem(rng)


def _repeat_digit(n: int, rng: random.Random) -> Iterator[Problem]:
    """``Repeat: 7`` → ``#### 7``: the ten digits in a shuffled order, again and again, so any ten
    consecutive problems ask each digit once (a validation split of 10 covers every prompt the task has)."""
    digits: list[int] = []
    for _ in range(n):
        if not digits:
            digits = rng.sample(range(10), 10)
        digit = digits.pop()
        yield Problem(question=f"Repeat: {digit}", answer=f"#### {digit}")


#: Each built-in data set's generator, by the name ``builtin:<name>`` gives.
GENERATORS: dict[str, Callable[[int, random.Random], Iterator[Problem]]] = {
    "arithmetic": _arithmetic, "repeat-digit": _repeat_digit}
assert tuple(GENERATORS) == BUILTIN_DATA, "constants.BUILTIN_DATA names the generators"


def generate_problems(n: int, *, seed: int = 0, kind: str = "arithmetic") -> Iterator[Problem]:
    """Yield ``n`` problems of the ``kind`` data set; the same ``(n, seed, kind)`` always yields the same."""
    yield from GENERATORS[kind](n, random.Random(seed))
