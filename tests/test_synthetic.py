"""The seeded arithmetic dataset of the offline demo."""

import re

from domains.math.dataset import load_problems
from domains.math.synthetic import generate_problems, write_problems
from schemas.config import DatasetConfig


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
