"""Writes the example datasets of this folder: competition-style problems whose answers are computed here.

    python data/generate.py          # rewrites data/train.jsonl and data/heldout.jsonl (same output every time)

Training and held-out problems come from different problem families, so that the leakage guard (character
5-gram Jaccard, see clgrpo/inputs/leakage.py) finds no near-duplicates between them: problems of one family differ only
in their numbers. Every answer is an integer computed by the code below, never typed by hand.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
Family = Callable[[random.Random], tuple[str, int]]


def divisible_by_either(rng: random.Random) -> tuple[str, int]:
    n, a, b = rng.randrange(300, 2000, 10), rng.randint(3, 9), rng.randint(10, 23)
    answer = n // a + n // b - n // math.lcm(a, b)
    return f"How many positive integers not exceeding {n} are divisible by {a} or by {b}?", answer


def power_remainder(rng: random.Random) -> tuple[str, int]:
    base, exponent, modulus = rng.randint(2, 19), rng.randint(50, 2024), rng.choice([7, 11, 13, 17, 19, 23])
    return f"What is the remainder when ${base}^{{{exponent}}}$ is divided by ${modulus}$?", pow(
        base, exponent, modulus
    )


def divisor_count(rng: random.Random) -> tuple[str, int]:
    n = rng.choice([2, 3, 5]) ** rng.randint(1, 4) * rng.choice([7, 11, 13]) ** rng.randint(1, 3) * rng.randint(1, 6)
    return f"How many positive divisors does ${n}$ have?", sum(1 for d in range(1, n + 1) if n % d == 0)


def digit_sum_of_power(rng: random.Random) -> tuple[str, int]:
    k = rng.randint(20, 60)
    return f"What is the sum of the digits of $2^{{{k}}}$?", sum(map(int, str(2**k)))


def non_adjacent_choices(rng: random.Random) -> tuple[str, int]:
    n, k = rng.randint(9, 16), rng.randint(3, 5)
    return (
        f"In how many ways can {k} of {n} chairs in a row be chosen so that no two chosen chairs are next to "
        "each other?"
    ), math.comb(n - k + 1, k)


def last_two_digits(rng: random.Random) -> tuple[str, int]:
    base, exponent = rng.choice([3, 7, 11, 13, 17]), rng.randint(100, 999)
    return f"What number is formed by the last two digits of ${base}^{{{exponent}}}$?", pow(base, exponent, 100)


def positive_solutions(rng: random.Random) -> tuple[str, int]:
    n, parts = rng.randint(10, 30), rng.randint(3, 4)
    names = ["a", "b", "c", "d"][:parts]
    equation = " + ".join(names)
    return (
        f"How many ordered {parts}-tuples of positive integers $({', '.join(names)})$ satisfy ${equation} = {n}$?"
    ), math.comb(n - 1, parts - 1)


def lcm_of_range(rng: random.Random) -> tuple[str, int]:
    k = rng.randint(8, 16)
    return f"What is the smallest positive integer that is divisible by every integer from 1 to {k}?", math.lcm(
        *range(1, k + 1)
    )


TRAIN: list[Family] = [
    divisible_by_either,
    power_remainder,
    divisor_count,
    digit_sum_of_power,
    non_adjacent_choices,
    last_two_digits,
    positive_solutions,
    lcm_of_range,
]


def grid_paths(rng: random.Random) -> tuple[str, int]:
    right, up = rng.randint(4, 9), rng.randint(4, 9)
    return (
        f"A token moves on a grid from $(0,0)$ to $({right},{up})$, one unit right or one unit up at a time. "
        "How many different routes can it take?"
    ), math.comb(right + up, right)


def sum_of_squares(rng: random.Random) -> tuple[str, int]:
    n = rng.randint(12, 60)
    return f"Compute $1^2 + 2^2 + 3^2 + \\cdots + {n}^2$.", n * (n + 1) * (2 * n + 1) // 6


def trailing_zeros(rng: random.Random) -> tuple[str, int]:
    n = rng.randint(60, 900)
    zeros, power = 0, 5
    while power <= n:
        zeros, power = zeros + n // power, power * 5
    return f"With how many zeros does the decimal expansion of ${n}!$ end?", zeros


def coprime_count(rng: random.Random) -> tuple[str, int]:
    n = rng.choice([36, 48, 60, 72, 84, 90, 100, 105, 120, 126, 144, 150])
    return f"How many integers from 1 to {n} share no common factor greater than 1 with {n}?", sum(
        1 for k in range(1, n + 1) if math.gcd(k, n) == 1
    )


HELDOUT: list[Family] = [grid_paths, sum_of_squares, trailing_zeros, coprime_count]


def generate(families: list[Family], per_family: int, prefix: str, seed: int) -> list[dict[str, str]]:
    rng, rows, seen = random.Random(seed), [], set()
    for family in families:
        made = 0
        while made < per_family:
            problem, answer = family(rng)
            if problem in seen:
                continue
            seen.add(problem)
            made += 1
            topic = family.__name__.replace("_", "-")
            rows.append({"id": f"{prefix}-{topic}-{made}", "problem": problem, "answer": str(answer), "topic": topic})
    return rows


def write(rows: list[dict[str, str]], path: Path) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")


if __name__ == "__main__":
    write(generate(TRAIN, 5, "train", seed=2024), HERE / "train.jsonl")
    write(generate(HELDOUT, 5, "heldout", seed=2025), HERE / "heldout.jsonl")
    print(f"wrote {HERE / 'train.jsonl'} and {HERE / 'heldout.jsonl'}")
