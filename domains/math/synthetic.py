"""Seeded generators of problem families with exact integer answers: datasets that need no download.

A *family* is a kind of problem sharing one idea, in several phrasings and with varied numbers, so that a lesson
learned on some of its problems can help on others (and a lesson learned on another family should not). The
same ``(family, n, seed)`` always gives the same problems; ids are ``<family>-<seed>-<k>``; texts are unique.

- ``arithmetic``: small sums, differences, products and two-step word problems (the original demo set).
- ``ranges``: how many whole numbers (pages, seats, days) lie in a range that includes both ends.
- ``percent``: by what percent a price rose or fell (the change over the original amount).
- ``units``: square and cubic metric unit conversions (the length factor squared or cubed).
- ``shares``: a fraction given away, then a fraction of what remains (not of the original).
- ``durations``: minutes between two clock times (hours have 60 minutes, not 100).
- ``boxes``: how many boxes (buses, shelves) hold everything: the quotient rounded up.
- ``workers``: more workers take fewer days (inverse, not direct, proportion).
- ``handshakes``: pairs among n people or teams: n(n-1)/2, each pair once.
- ``average``: the missing value from an average: the total is the average times the count.
- ``posts``: posts (trees, lamps) along a line, one every d metres, both ends included: L/d + 1, not L/d.
- ``speeds``: the average speed of a round trip at a km/h out and b km/h back: 2ab/(a+b), not (a+b)/2.
- ``overlaps``: how many like A or B (or neither) from |A|, |B| and |A and B|: subtract the overlap once.

``split_sets`` draws a training set and a held-out set of one family that the leakage guard passes (no problem of
one is a duplicate or near-duplicate of a problem of the other).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

from clgrpo.inputs.leakage import DuplicateIndex

Problem = tuple[str, int]
Generator = Callable[[random.Random], Problem]

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jade", "Kofi", "Lena"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "shells"]


# --- arithmetic (the original demo set) ---------------------------------------------------------------------
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
    return (
        f"{name} buys {boxes} packs of {each} {item} and finds {extra} more {item}. How many {item} does {name} have?"
    ), total


KINDS: list[Generator] = [_add, _subtract, _multiply, _buy_more, _give_away, _groups, _two_steps]


# --- ranges: both ends count ----------------------------------------------------------------------------------
def _range(rng: random.Random) -> Problem:
    first = rng.randint(3, 60)
    last = first + rng.randint(6, 60)
    count = last - first + 1
    phrasing = rng.randrange(3)  # (a fourth, book chapters by page, was dropped: 0% without a library at 0.3)
    if phrasing == 0:
        return f"How many integers are there from {first} to {last}, inclusive?", count
    if phrasing == 1:
        return f"The seats in a row are numbered {first} through {last}. How many seats are in the row?", count
    name = rng.choice(NAMES)
    return (
        f"{name} reads one story a day, from day {first} to day {last} of a challenge, both days included. "
        f"On how many days does {name} read?"
    ), count


# --- percent: change over the original ------------------------------------------------------------------------
def _percent(rng: random.Random) -> Problem:
    while True:
        original = rng.choice([20, 25, 40, 50, 60, 80, 120, 150, 200, 250, 400])
        percent = rng.choice([10, 20, 25, 40, 50, 75])
        if (original * percent) % 100 == 0:
            break
    change = original * percent // 100
    if rng.random() < 0.5:
        return (
            f"A price rises from {original} dollars to {original + change} dollars. By what percent did it rise?"
        ), percent
    return (
        f"A price falls from {original} dollars to {original - change} dollars. By what percent did it fall?"
    ), percent


# --- units: squared and cubed factors -------------------------------------------------------------------------
def _units(rng: random.Random) -> Problem:
    amount = rng.randint(2, 30)  # 2..9 held 48 problems: too few for 3 training seeds of 20 and 24 held out
    big, small, factor, power = rng.choice(
        [
            ("meters", "centimeters", 100, 2),
            ("centimeters", "millimeters", 10, 2),
            ("kilometers", "meters", 1000, 2),
            ("decimeters", "centimeters", 10, 3),
            ("meters", "decimeters", 10, 3),
            ("meters", "centimeters", 100, 3),
        ]
    )
    shape = "square" if power == 2 else "cubic"
    return f"How many {shape} {small} are in {amount} {shape} {big}?", amount * factor**power


# --- shares: a fraction of what remains -----------------------------------------------------------------------
def _shares(rng: random.Random) -> Problem:
    while True:
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        first, second = rng.choice([2, 3, 4, 5]), rng.choice([2, 3, 4])
        total = rng.randint(2, 8) * first * second
        remaining = total - total // first
        if remaining % second == 0:
            break
    left = remaining - remaining // second
    return (
        f"{name} has {total} {item}. {name} gives 1/{first} of them to a friend, then gives 1/{second} of the "
        f"remaining {item} to a neighbor. How many {item} does {name} have left?"
    ), left


# --- durations: clock times ----------------------------------------------------------------------------------
def _clock(minutes: int) -> str:
    return f"{minutes // 60}:{minutes % 60:02d}"


def _durations(rng: random.Random) -> Problem:
    while True:  # only spans whose end minutes are fewer than the start's: a plain subtraction must borrow an hour
        start = rng.randrange(6 * 60, 15 * 60, 5)
        length = rng.randrange(35, 5 * 60, 5)
        end = start + length
        if end % 60 < start % 60:
            break
    phrasing = rng.randrange(3)
    if phrasing == 0:
        return f"A train leaves at {_clock(start)} and arrives at {_clock(end)}. How many minutes is the trip?", length
    if phrasing == 1:
        return f"A film starts at {_clock(start)} and ends at {_clock(end)}. How many minutes long is it?", length
    name = rng.choice(NAMES)
    return (
        f"{name} starts baking at {_clock(start)} and finishes at {_clock(end)}. How many minutes does it take?"
    ), length


# --- boxes: round the quotient up ----------------------------------------------------------------------------
def _boxes(rng: random.Random) -> Problem:
    while True:
        size = rng.randint(4, 15)
        total = rng.randint(3 * size, 12 * size)
        if total % size:
            break
    needed = -(-total // size)
    phrasing = rng.randrange(3)
    if phrasing == 0:
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        return (
            f"{name} packs {total} {item} into boxes that hold {size} each. How many boxes does {name} need to pack "
            f"all of them?"
        ), needed
    if phrasing == 1:
        return (
            f"{total} students go on a trip in vans that seat {size} students each. How many vans are needed?"
        ), needed
    return f"A printer puts {size} photos on a sheet. How many sheets are needed to print {total} photos?", needed


# --- workers: inverse proportion -------------------------------------------------------------------------------
def _workers(rng: random.Random) -> Problem:
    while True:
        workers, days = rng.randint(2, 12), rng.randint(2, 15)
        other = rng.randint(2, 16)
        if other != workers and (workers * days) % other == 0:
            break
    answer = workers * days // other
    if rng.random() < 0.5:
        return (
            f"{workers} workers build a wall in {days} days. How many days would {other} workers take, working at "
            f"the same rate?"
        ), answer
    return (
        f"{workers} pumps empty a pool in {days} hours. How many hours would {other} such pumps take to empty it?"
    ), answer


# --- handshakes: each pair once ------------------------------------------------------------------------------
def _handshakes(rng: random.Random) -> Problem:
    n = rng.randint(4, 30)
    pairs = n * (n - 1) // 2
    phrasing = rng.randrange(3)
    if phrasing == 0:
        return f"At a meeting, {n} people each shake hands once with every other person. How many handshakes?", pairs
    if phrasing == 1:
        return (
            f"In a league of {n} teams, every team plays every other team exactly once. How many games are played?"
        ), pairs
    return f"How many straight lines join {n} points on a circle, one line for each pair of points?", pairs


# --- average: the missing value --------------------------------------------------------------------------------
def _average(rng: random.Random) -> Problem:
    count = rng.randint(3, 6)
    known = [rng.randint(5, 60) for _ in range(count - 1)]
    missing = rng.randint(5, 60)
    total = sum(known) + missing
    while total % count:
        missing += 1
        total += 1
    mean = total // count
    listed = ", ".join(str(x) for x in known[:-1]) + f" and {known[-1]}"
    if rng.random() < 0.5:
        return (
            f"The average of {count} numbers is {mean}. {count - 1} of them are {listed}. What is the other number?"
        ), missing
    name = rng.choice(NAMES)
    return (
        f"{name}'s average score over {count} tests is {mean}. The scores of the first {count - 1} tests were "
        f"{listed}. What did {name} score on the last test?"
    ), missing


# --- posts: both ends get one ----------------------------------------------------------------------------------
def _posts(rng: random.Random) -> Problem:
    gap = rng.choice([2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25])
    spans = rng.randint(4, 40)
    length = gap * spans
    posts = spans + 1  # the trap: length / gap, one short
    phrasing = rng.randrange(3)
    if phrasing == 0:
        return (
            f"A straight fence is {length} meters long, with a post every {gap} meters, including one post at each "
            f"end. How many posts are there?"
        ), posts
    if phrasing == 1:
        return (
            f"Trees are planted along one side of a {length}-meter road, one every {gap} meters, with a tree at both "
            f"ends of the road. How many trees are planted?"
        ), posts
    name = rng.choice(NAMES)
    return (
        f"{name} puts a lamp every {gap} meters along a straight path {length} meters long, from one end to the "
        f"other, with a lamp at each end. How many lamps does {name} put?"
    ), posts


# --- speeds: the round trip's average is not the mean of the speeds -----------------------------------------------
SPEED_PAIRS = [  # out and back in km/h, never equal, with an integer harmonic mean 2ab/(a+b)
    (a, b) for a in range(10, 121, 5) for b in range(10, 121, 5) if a != b and (2 * a * b) % (a + b) == 0
]


def _speeds(rng: random.Random) -> Problem:
    out, back = rng.choice(SPEED_PAIRS)
    average = 2 * out * back // (out + back)  # the trap: (out + back) / 2
    phrasing = rng.randrange(3)
    if phrasing == 0:
        return (
            f"A car drives from one town to another at {out} km/h and comes back along the same road at {back} km/h. "
            f"What is its average speed for the whole round trip, in km/h?"
        ), average
    if phrasing == 1:
        name = rng.choice(NAMES)
        return (
            f"{name} drives to a lake at {out} km/h and drives home by the same route at {back} km/h. What is "
            f"{name}'s average speed over the whole trip there and back, in km/h?"
        ), average
    return (
        f"A train travels from a city to the coast at {out} km/h and returns over the same distance at {back} km/h. "
        f"What is the train's average speed for the round trip, in km/h?"
    ), average


# --- overlaps: count the overlap once --------------------------------------------------------------------------
OVERLAP_TOPICS = [  # who, where, the verb, the two things
    ("students", "a class", "like", "tea", "coffee"),
    ("members", "a club", "play", "chess", "soccer"),
    ("people", "a survey", "own", "a cat", "a dog"),
]


def _overlaps(rng: random.Random) -> Problem:
    who, where, verb, first, second = rng.choice(OVERLAP_TOPICS)
    while True:
        group = rng.randint(20, 60)
        both = rng.randint(2, 15)
        a, b = both + rng.randint(1, 25), both + rng.randint(1, 25)
        either = a + b - both  # the trap: a + b, the overlap counted twice
        if either < group:
            break
    told = f"In {where} of {group} {who}, {a} {verb} {first}, {b} {verb} {second}, and {both} {verb} both."
    if rng.random() < 0.5:
        return f"{told} How many of the {who} {verb} at least one of the two?", either
    return f"{told} How many of the {who} {verb} neither?", group - either


FAMILIES: dict[str, Callable[[random.Random, int], Problem]] = {
    "arithmetic": lambda rng, k: KINDS[k % len(KINDS)](rng),
    "ranges": lambda rng, k: _range(rng),
    "percent": lambda rng, k: _percent(rng),
    "units": lambda rng, k: _units(rng),
    "shares": lambda rng, k: _shares(rng),
    "durations": lambda rng, k: _durations(rng),
    "boxes": lambda rng, k: _boxes(rng),
    "workers": lambda rng, k: _workers(rng),
    "handshakes": lambda rng, k: _handshakes(rng),
    "average": lambda rng, k: _average(rng),
    "posts": lambda rng, k: _posts(rng),
    "speeds": lambda rng, k: _speeds(rng),
    "overlaps": lambda rng, k: _overlaps(rng),
}
MAX_DRAWS = 200  # draws per problem before a family is out of unique problems


def generate_family(
    family: str, n: int, seed: int = 0, *, exclude: set[str] | frozenset[str] = frozenset(), ids: str | None = None
) -> list[dict[str, str]]:
    """``n`` unique problems of ``family``, none a duplicate of a text in ``exclude`` as the leakage guard
    measures it (the same text, or the same numbers in nearly the same words): ``{"id", "problem", "answer"}``
    rows with ids ``<ids>-<k>`` (default ``<family>-<seed>``)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}: choose one of {', '.join(FAMILIES)}")
    if n < 1:
        raise ValueError("n must be at least 1")
    rng, prefix = random.Random(f"{family}:{seed}"), ids or f"{family}-{seed}"
    rows: list[dict[str, str]] = []
    seen: set[str] = set()
    avoided = DuplicateIndex(exclude)
    draws = 0
    while len(rows) < n:
        text, answer = FAMILIES[family](rng, len(rows))
        draws += 1
        if draws > MAX_DRAWS * n:
            apart = f" apart from the {len(avoided)} excluded ones" if exclude else ""
            raise ValueError(f"family {family!r} has fewer than {n} distinct problems for seed {seed}{apart}")
        if text in seen or text in avoided:
            continue
        seen.add(text)
        rows.append({"id": f"{prefix}-{len(rows)}", "problem": text, "answer": str(answer)})
    return rows


def generate_problems(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` unique arithmetic problems cycling through its kinds (ids ``arith-<seed>-<k>``)."""
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


def split_sets(family: str, n_train: int, n_heldout: int, seed: int) -> tuple[list[dict], list[dict]]:
    """A training set and a held-out set of ``family`` drawn from different seeds, none a near-duplicate of the
    other's problems."""
    train = generate_family(family, n_train, seed, ids=f"{family}-train{seed}")
    heldout = generate_family(
        family, n_heldout, seed + 10_000, exclude={r["problem"] for r in train}, ids=f"{family}-heldout{seed}"
    )
    return train, heldout


def write_rows(path: str | Path, rows: list[dict[str, str]]) -> Path:
    """Write problems as JSON lines (the format ``dataset.path`` reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def write_problems(path: str | Path, n: int, seed: int = 0) -> Path:
    """Write ``n`` arithmetic problems as JSON lines."""
    return write_rows(path, generate_problems(n, seed))
