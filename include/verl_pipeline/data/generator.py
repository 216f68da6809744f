"""A deterministic generator of arithmetic word problems in GSM8K's format.

Each problem has a ``question`` and an ``answer`` whose last line is ``#### N``, like GSM8K, so
the same recipe and verl's GSM8K reward function handle both. Works offline.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

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


def generate_problems(n: int, *, seed: int = 0) -> Iterator[Problem]:
    """Yield ``n`` problems; the same ``(n, seed)`` always yields the same problems."""
    rng = random.Random(seed)
    for _ in range(n):
        yield _problem(rng)
