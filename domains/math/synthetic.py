"""A seeded generator of small arithmetic and word problems with exact integer answers.

Used by the offline demo (a dataset that needs no download) and handy for smoke tests of any model. The
same ``(n, seed)`` always gives the same problems; ids are ``arith-<seed>-<k>``; problem texts are unique.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

Problem = tuple[str, int]

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jade", "Kofi", "Lena"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells"]


def _add(rng: random.Random) -> Problem:
    a, b = rng.randint(2, 60), rng.randint(2, 60)
    return f"What is {a} + {b}?", a + b


def _subtract(rng: random.Random) -> Problem:
    a, b = sorted((rng.randint(2, 90), rng.randint(2, 90)), reverse=True)
    return f"What is {a} - {b}?", a - b


def _multiply(rng: random.Random) -> Problem:
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    return f"What is {a} times {b}?", a * b


def _buy_more(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    have, more = rng.randint(2, 30), rng.randint(2, 30)
    return f"{name} has {have} {item} and gets {more} more. How many {item} does {name} have now?", have + more


def _give_away(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    have = rng.randint(10, 50)
    gone = rng.randint(1, have - 1)
    return f"{name} had {have} {item} and gave away {gone}. How many {item} are left?", have - gone


def _groups(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    boxes, each = rng.randint(2, 9), rng.randint(2, 9)
    return f"{name} has {boxes} boxes with {each} {item} in each box. How many {item} are there in total?", boxes * each


def _two_steps(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    boxes, each = rng.randint(2, 6), rng.randint(2, 8)
    extra = rng.randint(1, 9)
    total = boxes * each + extra
    return (f"{name} buys {boxes} packs of {each} {item} and finds {extra} more {item}. "
            f"How many {item} does {name} have?"), total


KINDS: list[Callable[[random.Random], Problem]] = [_add, _subtract, _multiply, _buy_more, _give_away, _groups,
                                                   _two_steps]


def generate_problems(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` unique problems cycling through the kinds above: ``{"id", "problem", "answer"}`` rows."""
    if n < 1:
        raise ValueError("n must be at least 1")
    rng = random.Random(seed)
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    while len(rows) < n:
        text, answer = KINDS[len(rows) % len(KINDS)](rng)
        if text in seen:
            continue
        seen.add(text)
        rows.append({"id": f"arith-{seed}-{len(rows)}", "problem": text, "answer": str(answer)})
    return rows


def write_problems(path: str | Path, n: int, seed: int = 0) -> Path:
    """Write the problems as JSON lines (the format ``dataset.path`` reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in generate_problems(n, seed)), encoding="utf-8")
    return path
