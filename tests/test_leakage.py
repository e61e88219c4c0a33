"""The leakage guard: exact and near-duplicate problems shared by the training and the evaluation set."""

import random
import time

import pytest

from clgrpo.inputs.leakage import DuplicateIndex, LeakageError, check_leakage, find_leakage, jaccard, shingles
from clgrpo.testing.scripted_llm import make_problems
from schemas.records import Problem

WORDS = (
    "triangle integer sum find number circle radius prime digits probability area square real positive value "
    "expression compute remainder divided least greatest ordered pairs polynomial roots coefficient sequence "
    "terms arithmetic geometric chord tangent angle perimeter"
).split()


def random_problems(prefix: str, n: int, seed: int) -> list[Problem]:
    rng = random.Random(seed)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))) + f" {rng.randint(1, 10**6)}."

    return [Problem(problem_id=f"{prefix}{i}", problem=text()) for i in range(n)]


def test_planted_exact_and_near_duplicates_are_found_with_their_ids():
    train = random_problems("t", 200, seed=1)
    evaluation = random_problems("e", 200, seed=2)
    planted = {
        "e3": ("t10", "  " + train[10].problem.upper().replace(" ", "   ") + " "),  # exact after normalization
        "e50": ("t20", train[20].problem.replace("find", "determine", 1) + " Explain."),  # near duplicate
        "e77": ("t30", "Question: " + train[30].problem[:-1] + "?"),  # near duplicate
    }
    for eval_id, (_, text) in planted.items():
        index = int(eval_id[1:])
        evaluation[index] = Problem(problem_id=eval_id, problem=text)

    report = find_leakage(train, evaluation, threshold=0.8)
    assert report.eval_ids == sorted(planted)
    assert {(m.eval_id, m.train_id) for m in report.matches} == {(e, t) for e, (t, _) in planted.items()}
    assert [m.eval_id for m in report.exact] == ["e3"]
    assert all(0.8 <= m.similarity < 1 for m in report.near)
    message = report.message()
    assert "3 of 200 evaluation problems" in message and "e50~t20" in message and "1 exact" in message

    with pytest.raises(LeakageError, match="e3~t10"):
        check_leakage(train, evaluation, refuse=True)
    assert find_leakage(train, evaluation, threshold=1.0).eval_ids == ["e3"]  # exact only


def test_distinct_problems_of_one_template_are_not_flagged():
    train = [Problem(problem_id=p["id"], problem=p["problem"]) for p in make_problems(10, seed=1)]
    evaluation = [Problem(problem_id="x" + p["id"], problem=p["problem"]) for p in make_problems(10, seed=2)]
    report = check_leakage(train, evaluation)
    assert not report and "none of 40" in report.message()
    assert not find_leakage([], evaluation) and not find_leakage(train, [])


def test_similarity_is_exact_jaccard_of_character_5_grams():
    a, b = shingles("Compute 12 + 34."), shingles("compute 12 + 34")
    assert a == b and jaccard(a, b) == 1.0
    assert shingles("abc") == frozenset(["abc"])


def test_scales_to_thousands_of_problems():
    train = random_problems("t", 3000, seed=3)
    evaluation = random_problems("e", 3000, seed=4)
    evaluation[123] = Problem(problem_id="e123", problem=train[2999].problem + " (hard)")
    started = time.process_time()  # this process's CPU time: a loaded machine slows the wall clock, not this
    report = find_leakage(train, evaluation)
    assert report.eval_ids == ["e123"]
    assert time.process_time() - started < 15  # all 9 million pairs compared in Python would take minutes


def test_other_numbers_make_another_problem_unless_asked_otherwise():
    text = "Find the remainder when 123456 is divided by {}, and show your work."
    train = [Problem(problem_id="t", problem=text.format(17))]
    evaluation = [Problem(problem_id="e", problem=text.format(19))]
    assert not find_leakage(train, evaluation)
    assert find_leakage(train, evaluation, same_numbers=False).eval_ids == ["e"]


def test_the_duplicate_index_asks_the_guards_question_of_one_text():
    """What a generator asks of each problem it draws: a duplicate of a kept text, as the guard would flag it."""
    train = random_problems("t", 200, seed=5)
    evaluation = random_problems("e", 200, seed=6)
    evaluation[3] = Problem(problem_id="e3", problem="  " + train[10].problem.upper() + " ")  # exact
    evaluation[50] = Problem(problem_id="e50", problem=train[20].problem.replace("find", "determine", 1) + " Explain.")
    reworded = "Hana drives to a lake at 45 km/h and drives home by the same route at {} km/h. Her average speed?"
    train.append(Problem(problem_id="t200", problem=reworded.format(30)))
    evaluation.append(Problem(problem_id="e200", problem=reworded.format(30).replace("Hana", "Kofi")))
    evaluation.append(Problem(problem_id="e201", problem=reworded.format(60)))  # other numbers: another problem

    index = DuplicateIndex(p.problem for p in train)
    flagged = sorted(p.problem_id for p in evaluation if p.problem in index)
    assert flagged == find_leakage(train, evaluation).eval_ids == ["e200", "e3", "e50"]
    assert len(index) == 201 and 42 not in index
