"""The seeded synthetic problem families (arithmetic, ranges, ...) and `clgrpo data make`."""

import re

from clgrpo.inputs.dataset import load_problems
from domains.math.synthetic import generate_problems, write_problems
from schemas.config import DatasetConfig
from schemas.records import Problem


def expected_answer(problem: str) -> int:
    """Recompute each problem kind's answer from its text."""
    numbers = [int(n) for n in re.findall(r"\d+", problem)]
    if "+" in problem or "gets" in problem:
        return numbers[0] + numbers[1]
    if " - " in problem or "gave away" in problem:
        return numbers[0] - numbers[1]
    if "packs of" in problem:
        return numbers[0] * numbers[1] + numbers[2]
    return numbers[0] * numbers[1]  # "times", boxes with ... in each


def test_seeded_unique_and_exact():
    rows = generate_problems(60, seed=3)
    assert rows == generate_problems(60, seed=3) and rows != generate_problems(60, seed=4)
    assert len({r["id"] for r in rows}) == 60 and len({r["problem"] for r in rows}) == 60
    for row in rows:
        assert int(row["answer"]) == expected_answer(row["problem"]) and int(row["answer"]) >= 0


def test_written_file_loads_as_a_dataset(tmp_path):
    path = write_problems(tmp_path / "data" / "arith.jsonl", 8, seed=0)
    problems = load_problems(DatasetConfig(path=str(path), shuffle=False))
    assert [p.problem_id for p in problems] == [f"arith-0-{i}" for i in range(8)]
    assert all(p.answer for p in problems)


def test_families_answer_their_own_questions():
    from domains.math.synthetic import FAMILIES, generate_family

    for family in FAMILIES:
        rows = generate_family(family, 30, seed=5)
        assert rows == generate_family(family, 30, seed=5) and len({r["problem"] for r in rows}) == 30
    for row in generate_family("ranges", 40, seed=1):
        first, last = [int(n) for n in re.findall(r"\d+", row["problem"])][:2]
        assert int(row["answer"]) == last - first + 1


def numbers(row: dict) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", row["problem"])]


def test_the_newer_families_answer_by_their_rule_and_lay_their_trap():
    from domains.math.synthetic import generate_family

    for row in generate_family("durations", 40, seed=2):
        h1, m1, h2, m2 = numbers(row)
        assert int(row["answer"]) == (h2 * 60 + m2) - (h1 * 60 + m1) and m2 < m1  # a plain subtraction must borrow
    for row in generate_family("boxes", 40, seed=2):
        a, b = numbers(row)
        size, total = (a, b) if "photos" in row["problem"] else (b, a)  # "puts {size} photos ... print {total}"
        assert int(row["answer"]) == -(-total // size) and total % size  # rounding down would be wrong
    for row in generate_family("workers", 40, seed=2):
        workers, days, other = numbers(row)
        assert int(row["answer"]) * other == workers * days
    for row in generate_family("handshakes", 40, seed=2):
        (n,) = numbers(row)
        assert int(row["answer"]) == n * (n - 1) // 2
    for row in generate_family("average", 40, seed=2):
        count, mean, _, *known = numbers(row)
        assert sum(known) + int(row["answer"]) == count * mean


def test_cli_data_make_writes_a_held_out_set_disjoint_from_training(tmp_path, capsys):
    from application.cli import main

    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    assert main(["data", "make", "ranges", "--n", "20", "--seed", "0", "--out", str(train)]) == 0
    assert (
        main(["data", "make", "ranges", "--n", "30", "--seed", "0", "--out", str(held), "--exclude", str(train)]) == 0
    )
    assert "none of the 20 problems of" in capsys.readouterr().out
    seen = {p.problem for p in load_problems(DatasetConfig(path=str(train), shuffle=False))}
    held_out = load_problems(DatasetConfig(path=str(held), shuffle=False))
    assert len(held_out) == 30 and not seen & {p.problem for p in held_out}  # same seed, yet disjoint
    assert main(["data", "make", "nonsense", "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "unknown family 'nonsense'" in capsys.readouterr().err


def test_every_family_holds_the_learning_benchmarks_problems():
    """benchmarks/learning.py's default: 3 training seeds of 20 problems and 24 held-out problems that the leakage
    guard passes against all of them (`units` once held only 48 distinct problems; `speeds` once drew 4 held-out
    problems that another name made near-duplicates of training problems, and `--refuse-on-leakage` refused them)."""
    from clgrpo.inputs.leakage import find_leakage
    from domains.math.synthetic import FAMILIES, generate_family, split_sets

    def problems(rows: list[dict]) -> list[Problem]:
        return [Problem(problem_id=r["id"], problem=r["problem"]) for r in rows]

    for family in FAMILIES:
        train = [r for seed in (0, 1, 2) for r in generate_family(family, 20, seed, ids=f"t{seed}")]
        heldout = generate_family(family, 24, 1000, exclude={r["problem"] for r in train}, ids="h")
        assert len({r["problem"] for r in heldout}) == 24
        assert not find_leakage(problems(train), problems(heldout)), family
        assert not find_leakage(*map(problems, split_sets(family, 40, 40, seed=0))), family


def template(text: str) -> str:
    """A problem's phrasing: its text with the numbers and names taken out."""
    from domains.math.synthetic import NAMES

    for name in NAMES:
        text = text.replace(name, "NAME")
    return re.sub(r"\d+", "#", text)


def rule_and_trap(family: str, row: dict) -> tuple[int, int | float]:
    """Issue 57's families: the answer by the family's rule, and the answer its trap gives."""
    text, found = row["problem"], numbers(row)
    if family == "posts":  # one every d meters along L, both ends: L/d + 1 (the trap: L/d)
        gap = int(re.search(r"every (\d+) meters", text).group(1))
        (length,) = [n for n in found if n != gap]
        assert length % gap == 0
        return length // gap + 1, length / gap
    if family == "speeds":  # a round trip at a out, b back: 2ab/(a+b) (the trap: (a+b)/2)
        out, back = found
        assert out != back and 2 * out * back % (out + back) == 0
        return 2 * out * back // (out + back), (out + back) / 2
    group, a, b, both = found  # overlaps: |A or B| = |A| + |B| - |A and B| (the trap: |A| + |B|)
    assert both <= min(a, b) and a + b - both <= group
    if text.endswith("neither?"):
        return group - (a + b - both), group - (a + b)
    return a + b - both, a + b


def test_posts_speeds_and_overlaps_answer_by_their_rule_never_by_their_trap():
    from domains.math.synthetic import generate_family

    for family in ("posts", "speeds", "overlaps"):
        for seed in (0, 1, 2, 1000):
            rows = generate_family(family, 60, seed)
            assert rows == generate_family(family, 60, seed) and rows != generate_family(family, 60, seed + 1)
            assert len({r["problem"] for r in rows}) == 60
            for row in rows:
                rule, trap = rule_and_trap(family, row)
                assert int(row["answer"]) == rule != trap, row
            assert len({template(r["problem"]) for r in rows}) >= 3, family  # several phrasings
            assert len({r["answer"] for r in rows}) >= 10, family  # and varied numbers
    overlaps = generate_family("overlaps", 60, 0)
    assert {r["problem"].endswith("neither?") for r in overlaps} == {True, False}  # both questions asked
