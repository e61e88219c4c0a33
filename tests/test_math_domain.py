"""The math domain: dataset loading and validation, math-verify grading (from threads, with timeouts), prompts."""

from __future__ import annotations

import csv
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

import domains.math.verify as verify_mod
from domains import Domain, VerifyResult, get_domain
from domains.math import (
    DatasetError,
    MathDomain,
    load_problems,
    load_problems_with_report,
    normalize_problem_text,
    rollout_messages,
)
from domains.math.verify import verify_batch, verify_output
from schemas.config import DatasetConfig
from schemas.records import Problem

AIME = Path(__file__).resolve().parent / "data" / "aime2024.jsonl"

ROWS = [
    {"id": "p1", "problem": "What is $1+1$?", "answer": "2"},
    {"id": "p2", "problem": "Compute $3 \\cdot 4$.", "answer": "12"},
    {"id": "p3", "problem": "Find $x$ if $2x = 10$.", "answer": "5"},
]


def _slow_worker(output: str, answer: str, timeout_s: float) -> VerifyResult:
    """A grader that hangs past any deadline (runs in the spawned child; must stay module-level)."""
    time.sleep(60)
    return VerifyResult(1.0)


def _tagging_worker(output: str, answer: str, timeout_s: float) -> VerifyResult:
    """A grader that proves this test module can be imported in the spawned child."""
    return VerifyResult(1.0, f"tagged:{output}:{answer}")


def _sleepy_worker(output: str, answer: str, timeout_s: float) -> VerifyResult:
    """A slow but healthy grader: 0.1 s per item."""
    time.sleep(0.1)
    return VerifyResult(1.0, output)


def _one_second_worker(output: str, answer: str, timeout_s: float) -> VerifyResult:
    """Keeps its child busy for a second (sleeping: no CPU budget used)."""
    time.sleep(1.0)
    return VerifyResult(1.0, output)


def _thread_probe_worker(output: str, answer: str, timeout_s: float) -> VerifyResult:
    """Reports whether the child runs items in its main thread (where math-verify's alarms work)."""
    return VerifyResult(1.0, str(threading.current_thread() is threading.main_thread()))


def _cfg(path: Path, **kw: Any) -> DatasetConfig:
    return DatasetConfig(path=str(path), **{"shuffle": False, **kw})


def _write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    """Write rows in the format given by the suffix."""
    if path.suffix == ".jsonl":
        return _write_jsonl(path, rows)
    if path.suffix == ".json":
        path.write_text(json.dumps({"data": rows}), encoding="utf-8")
    elif path.suffix == ".csv":
        with path.open("w", newline="", encoding="utf-8") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        pd.DataFrame(rows).to_parquet(path)
    return path


def _error(cfg: DatasetConfig) -> str:
    with pytest.raises(DatasetError) as info:
        load_problems(cfg)
    return str(info.value)


# --- loading -------------------------------------------------------------------------------------------


def test_aime_loads_thirty_problems_with_ids_and_answers() -> None:
    problems, report = load_problems_with_report(DatasetConfig(path=str(AIME), shuffle=False))
    assert len(problems) == 30
    assert report.n_rows == 30 and report.n_duplicates_dropped == 0 and report.n_after_limit == 30
    assert problems[0].problem_id == "aime2024-00" and problems[0].answer == "204"
    assert problems[0].source == "aime2024.jsonl"
    assert len({p.problem_id for p in problems}) == 30
    assert all(p.answer and p.answer.isdigit() for p in problems)


def test_seeded_shuffle_is_deterministic_and_seed_dependent() -> None:
    def ids(seed: int) -> list[str]:
        return [p.problem_id for p in load_problems(DatasetConfig(path=str(AIME), shuffle=True, seed=seed))]

    assert ids(1) == ids(1)
    assert ids(1) != ids(2)
    assert sorted(ids(1)) == sorted(ids(2))
    unshuffled = [p.problem_id for p in load_problems(DatasetConfig(path=str(AIME), shuffle=False))]
    assert ids(1) != unshuffled


def test_limit_truncates_after_shuffle() -> None:
    full = load_problems(DatasetConfig(path=str(AIME), seed=3))
    problems, report = load_problems_with_report(DatasetConfig(path=str(AIME), seed=3, limit=7))
    assert [p.problem_id for p in problems] == [p.problem_id for p in full[:7]]
    assert report.n_rows == 30 and report.n_after_limit == 7


def test_duplicate_problem_is_dropped_and_counted(tmp_path: Path) -> None:
    rows = [json.loads(line) for line in AIME.read_text(encoding="utf-8").splitlines()]
    planted = {"id": "planted", "problem": "  " + rows[4]["problem"].upper().replace(" ", "   \n") + " ", "answer": "1"}
    path = _write_jsonl(tmp_path / "aime_dup.jsonl", rows + [planted])
    problems, report = load_problems_with_report(_cfg(path))
    assert len(problems) == 30
    assert "planted" not in {p.problem_id for p in problems}
    assert report.n_rows == 31 and report.n_duplicates_dropped == 1 and report.dropped_ids == ("planted",)
    kept = next(p for p in problems if p.problem_id == rows[4]["id"])
    assert kept.answer == rows[4]["answer"]  # the first occurrence wins


def test_normalize_problem_text() -> None:
    assert normalize_problem_text("  What IS\n\t $1+1$?  ") == "what is $1+1"
    assert normalize_problem_text("What is $1+1$") == normalize_problem_text("what   is $1+1$ ?")


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_formats_round_trip(tmp_path: Path, suffix: str) -> None:
    reference = load_problems(_cfg(_write(tmp_path / "ref.jsonl", ROWS)))
    problems = load_problems(_cfg(_write(tmp_path / f"ref{suffix}", ROWS)))
    assert [p.model_dump(exclude={"source"}) for p in problems] == [p.model_dump(exclude={"source"}) for p in reference]
    assert {p.source for p in problems} == {f"ref{suffix}"}


def test_json_plain_list_and_other_wrapper_keys(tmp_path: Path) -> None:
    for name, payload in [("list.json", ROWS), ("problems.json", {"problems": ROWS}), ("rows.json", {"rows": ROWS})]:
        path = tmp_path / name
        path.write_text(json.dumps(payload), encoding="utf-8")
        assert [p.problem_id for p in load_problems(_cfg(path))] == ["p1", "p2", "p3"]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_configurable_field_names(tmp_path: Path, suffix: str) -> None:
    rows = [{"qid": r["id"], "question": r["problem"], "final_answer": r["answer"]} for r in ROWS]
    path = _write(tmp_path / f"renamed{suffix}", rows)
    cfg = _cfg(path, id_field="qid", problem_field="question", answer_field="final_answer")
    problems = load_problems(cfg)
    assert [(p.problem_id, p.answer) for p in problems] == [("p1", "2"), ("p2", "12"), ("p3", "5")]


def test_missing_id_column_derives_ids_and_no_answer_field(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "noids.jsonl", [{"problem": r["problem"]} for r in ROWS])
    problems = load_problems(_cfg(path, answer_field=None))
    assert [p.problem_id for p in problems] == ["noids-00000", "noids-00001", "noids-00002"]
    assert all(p.answer is None for p in problems)
    assert [p.problem_id for p in load_problems(_cfg(path, id_field=None, answer_field=None))] == [
        p.problem_id for p in problems
    ]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_task_tags_come_from_the_tag_column_when_there_is_one(tmp_path: Path, suffix: str) -> None:
    tags = ["geometry", "", 7]  # a blank cell: untagged; a number becomes text
    path = _write(tmp_path / f"tagged{suffix}", [{**r, "tag": t} for r, t in zip(ROWS, tags)])
    assert [p.tag for p in load_problems(_cfg(path))] == ["geometry", None, "7"]
    assert [p.tag for p in load_problems(_cfg(path, tag_field=None))] == [None, None, None]
    renamed = _write_jsonl(tmp_path / "family.jsonl", [{**r, "family": "algebra"} for r in ROWS])
    assert {p.tag for p in load_problems(_cfg(renamed, tag_field="family"))} == {"algebra"}
    assert {p.tag for p in load_problems(_cfg(renamed))} == {None}  # no "tag" column: no tags
    wrong = _write_jsonl(tmp_path / "wrong.jsonl", [{**ROWS[0], "tag": ["a"]}])
    with pytest.raises(DatasetError, match=r"field 'tag': wrong type: expected text or a number \(or empty: untagged"):
        load_problems(_cfg(wrong))


def test_numeric_answers_become_text(tmp_path: Path) -> None:
    rows = [
        {"id": 1, "problem": "a?", "answer": 204},
        {"id": 2, "problem": "b?", "answer": 204.0},
        {"id": 3, "problem": "c?", "answer": 0.5},
        {"id": 4, "problem": "d?", "answer": " 7 "},
    ]
    for path in (_write_jsonl(tmp_path / "num.jsonl", rows), _write(tmp_path / "num.parquet", rows[:3])):
        problems = load_problems(_cfg(path))
        assert [p.answer for p in problems] == ["204", "204", "0.5", "7"][: len(problems)]
        assert [p.problem_id for p in problems] == ["1", "2", "3", "4"][: len(problems)]


def test_empty_files(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n\n", encoding="utf-8")
    (tmp_path / "empty.csv").write_text("id,problem,answer\n", encoding="utf-8")
    assert "empty.jsonl: contains no rows" in _error(_cfg(tmp_path / "empty.jsonl"))
    assert "empty.csv: contains no rows" in _error(_cfg(tmp_path / "empty.csv"))


def test_missing_file_and_unknown_extension(tmp_path: Path) -> None:
    assert "not found" in _error(_cfg(tmp_path / "nope.jsonl"))
    (tmp_path / "data.txt").write_text("x", encoding="utf-8")
    assert "unsupported file type" in _error(_cfg(tmp_path / "data.txt"))


def test_hub_dataset_without_datasets_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    message = _error(DatasetConfig(hf_name="someone/aime"))
    assert "pip install clgrpo[datasets]" in message


def test_hub_dataset_through_datasets_api(monkeypatch: pytest.MonkeyPatch) -> None:
    class FakeSplit:
        def to_pandas(self) -> pd.DataFrame:
            return pd.DataFrame([{"problem": r["problem"], "answer": r["answer"]} for r in ROWS])

    class FakeDatasets:
        @staticmethod
        def load_dataset(name: str, config: str | None, split: str) -> FakeSplit:
            assert (name, config, split) == ("someone/aime", None, "test")
            return FakeSplit()

    monkeypatch.setitem(sys.modules, "datasets", FakeDatasets)
    problems = load_problems(DatasetConfig(hf_name="someone/aime", hf_split="test", shuffle=False))
    assert [p.problem_id for p in problems] == ["aime-00000", "aime-00001", "aime-00002"]
    assert {p.source for p in problems} == {"someone/aime"}


# --- malformed datasets --------------------------------------------------------------------------------


def test_missing_column_is_named(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "noanswer.jsonl", [{"id": r["id"], "problem": r["problem"]} for r in ROWS])
    message = _error(_cfg(path))
    assert "noanswer.jsonl field 'answer': missing column" in message


@pytest.mark.parametrize(
    ("row", "field", "what"),
    [
        ({"id": "x", "problem": "", "answer": "1"}, "problem", "empty"),
        ({"id": "x", "problem": "q?", "answer": "   "}, "answer", "empty"),
        ({"id": "x", "problem": ["q?"], "answer": "1"}, "problem", "wrong type: expected text, got list"),
        ({"id": "x", "problem": 12, "answer": "1"}, "problem", "wrong type: expected text, got int"),
        ({"id": "x", "problem": "q?", "answer": {"v": 1}}, "answer", "wrong type: expected text or a number, got dict"),
        ({"id": "x", "problem": "q?"}, "answer", "missing"),
        ({"id": "x", "problem": None, "answer": "1"}, "problem", "missing"),
    ],
)
def test_bad_cell_names_file_line_and_field(tmp_path: Path, row: dict, field: str, what: str) -> None:
    path = _write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], ROWS[1], row])  # the bad row is on line 3
    message = _error(_cfg(path))
    assert f"bad.jsonl row at line 3 field '{field}': {what}" in message
    assert "1 problem(s)" in message


def test_bad_json_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + '{"id": "p2", "problem": "oops"\n', encoding="utf-8")
    message = _error(_cfg(path))
    assert "broken.jsonl row at line 3: invalid JSON" in message


def test_bad_json_file_names_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('[\n {"id": "p1", "problem": "q", "answer": "1"},\n {"id": \n]', encoding="utf-8")
    assert "broken.json at line 4: invalid JSON" in _error(_cfg(path))


def test_duplicate_ids_are_reported(tmp_path: Path) -> None:
    rows = [ROWS[0], {**ROWS[1], "id": "p1"}, ROWS[2]]
    message = _error(_cfg(_write_jsonl(tmp_path / "dupids.jsonl", rows)))
    assert "dupids.jsonl row at line 2 field 'id': duplicate id 'p1' (first at line 1)" in message


def test_csv_errors_use_file_lines(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text('id,problem,answer\np1,"multi\nline problem",1\np2,,2\np3,q,\n', encoding="utf-8")
    message = _error(_cfg(path))
    assert "bad.csv row at line 4 field 'problem': empty" in message
    assert "bad.csv row at line 5 field 'answer': empty" in message


def test_parquet_errors_use_row_index(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad.parquet", [ROWS[0], {"id": "p2", "problem": "q", "answer": None}])
    assert "bad.parquet row at index 1 field 'answer': missing" in _error(_cfg(path))


def test_many_problems_are_all_counted_and_listed_up_to_a_cap(tmp_path: Path) -> None:
    rows = [{"id": f"r{i}", "problem": "", "answer": ""} for i in range(30)]
    message = _error(_cfg(_write_jsonl(tmp_path / "empty.jsonl", rows)))
    assert "60 problem(s)" in message
    assert "... and 40 more" in message
    assert "row at line 1 field 'problem': empty" in message
    assert "SchemaErrors" not in message and "failure_case" not in message


# --- verification --------------------------------------------------------------------------------------


def _aime_answers() -> list[str]:
    return [json.loads(line)["answer"] for line in AIME.read_text(encoding="utf-8").splitlines() if line.strip()]


def test_verify_realistic_outputs_against_all_aime_answers() -> None:
    items: list[tuple[str, str]] = []
    expected: list[float] = []
    for answer in _aime_answers():
        a = int(answer)
        right = [
            f"Adding the two cases gives the total, so the answer is \\boxed{{{a}}}.",
            f"After simplifying everything. The answer is {a}",
            f"Therefore the count is $$\\frac{{{2 * a}}}{{2}}$$",
            f"We get $m+n = {a}$. Final answer: $\\boxed{{{a}}}$",
        ]
        wrong = [f"so the answer is \\boxed{{{a + 1}}}.", f"The answer is {a + 1}"]
        items += [(text, answer) for text in right + wrong]
        expected += [1.0] * len(right) + [0.0] * len(wrong)
    results = verify_batch(items)
    wrong_grades = [(items[i][0], r) for i, r in enumerate(results) if r.reward != expected[i] or not r.verified]
    assert not wrong_grades, wrong_grades[:5]
    assert all(r.error is None and r.verified for r in results)
    assert results[0].extracted == _aime_answers()[0]


def test_verify_empty_and_garbage_outputs() -> None:
    empty, blank, garbage, no_answer = verify_batch([("", "5"), ("  \n", "5"), ("asdf {{ ]]", "5"), ("x", "")])
    assert empty.reward == 0.0 and empty.error == "empty output" and empty.extracted is None and empty.verified
    assert blank.reward == 0.0 and blank.error == "empty output" and blank.verified
    assert garbage.reward == 0.0 and garbage.error is not None and garbage.verified  # a genuine grade
    assert no_answer.verified is False and no_answer.error == "no reference answer"  # nothing to grade against


def test_verify_single_and_latex_answers() -> None:
    assert verify_output("so $x = \\frac{1}{2}$", "0.5").reward == 1.0
    assert verify_output("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}").reward == 1.0
    result = verify_output("\\boxed{3}", "4")
    assert result == VerifyResult(0.0, "3", None) and result.verified


def test_verify_from_worker_threads() -> None:
    """The reason for the subprocess design: math-verify's signal-based timeouts fail outside the main thread."""
    items = [(f"The answer is \\boxed{{{n}}}", str(n)) for n in range(12)] + [("The answer is 3", "4")]
    with ThreadPoolExecutor(max_workers=4) as pool:
        singles = list(pool.map(lambda item: verify_output(*item), items))
        batches = list(pool.map(verify_batch, [items[:6], items[6:]]))
    assert [r.reward for r in singles] == [1.0] * 12 + [0.0]
    assert [r.reward for batch in batches for r in batch] == [1.0] * 12 + [0.0]

    box: list[VerifyResult] = []
    thread = threading.Thread(target=lambda: box.append(verify_output("\\boxed{204}", "204")))
    thread.start()
    thread.join(timeout=30)
    assert box == [VerifyResult(1.0, "204", None)]


def test_custom_worker_runs_in_the_child() -> None:
    assert verify_batch([("out", "ans")], worker=_tagging_worker) == [VerifyResult(1.0, "tagged:out:ans")]


def test_children_grade_in_their_main_thread() -> None:
    box: list[list[VerifyResult]] = []
    thread = threading.Thread(target=lambda: box.append(verify_batch([("x", "1")], worker=_thread_probe_worker)))
    thread.start()
    thread.join(timeout=30)
    assert box == [[VerifyResult(1.0, "True")]]


def test_timeout_kills_the_pool_and_the_next_call_works(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verify_mod, "HANG_FACTOR", 1.0)  # hung: still running 0.5 + 0.2 s after it started
    monkeypatch.setattr(verify_mod, "DEADLINE_MARGIN_S", 0.2)
    start = time.monotonic()
    (result,) = verify_batch([("\\boxed{1}", "1")], timeout_s=0.5, worker=_slow_worker)
    assert time.monotonic() - start < 10
    assert result.verified is False and "timeout" in (result.error or "")
    assert verify_output("\\boxed{1.0}", "1") == VerifyResult(1.0, "1.0", None, verified=True)  # graded in the pool


def test_queueing_behind_other_threads_is_not_a_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A short item queued behind another thread's long batch waits longer than its limit, yet is not hung."""
    monkeypatch.setattr(verify_mod, "DEADLINE_MARGIN_S", 0.2)
    verify_output("\\boxed{1.0}", "1")  # pool started before the clock matters
    long_batch = [(f"a{n}", "1") for n in range(30)]  # 0.1 s each: 3 s on one child, 1.5 s on two
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(verify_batch, long_batch, 0.3, _sleepy_worker)
        time.sleep(0.1)
        second = pool.submit(verify_batch, [("b", "1")], 0.3, _sleepy_worker)
        results = first.result() + second.result()
    assert [r.error for r in results] == [None] * 31
    assert all(r.verified for r in results)
    assert [r.extracted for r in results] == [f"a{n}" for n in range(30)] + ["b"]


def test_timeout_of_one_item_keeps_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verify_mod, "HANG_FACTOR", 1.0)
    monkeypatch.setattr(verify_mod, "DEADLINE_MARGIN_S", 0.2)
    hung = verify_batch([("\\boxed{1}", "1")] * 2, timeout_s=0.5, worker=_slow_worker)
    assert all(r.verified is False and "timeout" in (r.error or "") for r in hung)
    results = verify_batch([("\\boxed{1.0}", "1"), ("\\boxed{2.0}", "3"), ("", "1")])
    assert [r.reward for r in results] == [1.0, 0.0, 0.0]
    assert all(r.verified for r in results)


# --- prompts and the domain ------------------------------------------------------------------------------


def _problem(pid: str, text: str) -> Problem:
    return Problem(problem_id=pid, problem=text, answer="1")


def test_rollout_messages_put_the_library_first() -> None:
    library = "[E1] Check small cases first.\n[E2] Verify the final count."
    messages = rollout_messages(_problem("a", "Find the number of primes below 10."), library)
    assert [m["role"] for m in messages] == ["system", "user"]
    user = messages[1]["content"]
    assert user.startswith("Experiences learned from earlier attempts")
    assert user.index(library) < user.index("Problem:\n") < user.index("Find the number of primes")
    # nothing problem-independent after the problem but the constant closing tag
    assert user.endswith("Find the number of primes below 10.\n</problem>")
    assert "\\boxed{}" in messages[0]["content"]  # the answer format is part of the shared prefix


def test_rollouts_share_the_prefix_up_to_the_problem() -> None:
    library = "[E1] Draw a diagram."
    first = rollout_messages(_problem("a", "Alpha problem {x}."), library)
    second = rollout_messages(_problem("b", "Beta problem."), library)
    assert first[0] == second[0]
    prefix = first[1]["content"].split("Alpha problem")[0]
    assert second[1]["content"].startswith(prefix)
    assert prefix.endswith("Problem:\n<problem>\n") and library in prefix
    assert "Alpha problem {x}." in first[1]["content"]  # braces in problems survive formatting


def test_rollout_without_library() -> None:
    user = rollout_messages(_problem("a", "What is 2+2?"), "  ")[1]["content"]
    assert user.startswith("Problem:\n<problem>\nWhat is 2+2?")
    assert "Experiences" not in user


def test_math_domain_is_registered_and_complete(tmp_path: Path) -> None:
    domain = get_domain("math")
    assert isinstance(domain, MathDomain) and isinstance(domain, Domain)
    assert domain.warm() is None  # starts the pool in the background (idempotent)
    assert domain.name == "math" and [t.name for t in domain.tools()] == ["python"]
    path = _write_jsonl(tmp_path / "small.jsonl", ROWS)
    problems, report = domain.load_dataset(_cfg(path))
    assert [p.problem_id for p in problems] == ["p1", "p2", "p3"] and report.n_after_limit == 3
    assert domain.verify("\\boxed{2}", "2").reward == 1.0
    assert [r.reward for r in domain.verify_batch([("\\boxed{2}", "2"), ("\\boxed{3}", "2")])] == [1.0, 0.0]


INTEGER_CASES = [
    ("So the answer is \\boxed{42}.", "42"),
    ("\\boxed{42}", "17"),
    ("We get $\\boxed{ 204 }$", "204"),
    ("\\boxed{042}", "42"),
    ("\\boxed{-3}", "-3"),
    ("\\boxed{-3}", "3"),
    ("answer: \\boxed{+7}", "7"),
    ("First 12, then 15, finally \\boxed{15}", "15"),
    ("Final: \\boxed{15} though 12 looked right", "12"),
    ("\\boxed{0}", "0"),
    ("x = 5 so \\boxed{25}", "025"),
    ("The total is \\boxed{1000}.", "1000"),
]
SLOW_PATH_CASES = [  # not decided by the integer rule: math-verify grades them
    ("\\boxed{3} or \\boxed{4}", "4"),
    ("\\boxed{\\frac{1}{2}}", "1/2"),
    ("\\boxed{42}", "42.0"),
    ("The answer is 42.", "42"),
    ("\\boxed{x=5}", "5"),
    ("\\fbox{7} and \\boxed{7}", "7"),
    ("\\boxed{2^{10}}", "1024"),
]


@pytest.mark.parametrize("output, answer", INTEGER_CASES)
def test_integer_answers_are_graded_without_a_child_exactly_as_math_verify_grades_them(output, answer):
    from clgrpo.sandbox.verify_child import preload_verifier
    from domains.math.verify import _grade_one, integer_answer

    preload_verifier()  # in this process too: math-verify loaded, its no-timeout notice silenced as in the children
    fast, slow = integer_answer(output, answer), _grade_one(output, answer, 5.0)
    assert fast is not None and fast.verified
    assert (fast.reward, fast.extracted) == (slow.reward, slow.extracted), (fast, slow)


@pytest.mark.parametrize("output, answer", SLOW_PATH_CASES)
def test_anything_but_one_boxed_integer_against_an_integer_goes_to_math_verify(output, answer):
    from domains.math.verify import integer_answer

    assert integer_answer(output, answer) is None


def test_start_markers_are_read_even_when_every_item_finished_before_it_was_collected() -> None:
    """Each item's child writes a start marker to a pipe; a batch whose items were all done before the parent
    looked used to leave them unread, and ~2,000 unread markers filled the pipe until the children blocked (the
    pool then "started nothing" and batches came back unverified)."""
    import itertools

    generation = verify_mod._POOL.acquire()
    for round_ in range(3):
        tokens = itertools.count(round_ * 1000)
        handles = [
            (i, token, generation.submit(_tagging_worker, token, f"o{i}", "a", 5.0))
            for i, token in zip(range(200), tokens)
        ]
        for _, _, handle in handles:
            handle.wait(30)
        results: list = [None] * len(handles)
        assert verify_mod._collect(handles, generation, 5.0, results, time.monotonic()) == ([], "done")
        assert generation._events.empty() and not generation._started
        assert [r.extracted for r in results] == [f"tagged:o{i}:a" for i in range(200)]


def test_a_pool_idle_longer_than_the_stall_limit_still_grades_the_next_batch(monkeypatch) -> None:
    """The stall limit counts from the batch's submission: a pool whose last activity is older than the limit
    (a long learner stage between two verification phases) is idle, not stalled. It used to fail the next batch
    at once as "the worker pool started nothing for 150s" whenever its first item did not start at once."""
    generation = verify_mod._POOL.acquire()
    monkeypatch.setattr(verify_mod, "_stall_limit", lambda timeout_s: 3.0)
    busy = [(next(verify_mod._TOKENS), None) for _ in range(verify_mod.POOL_PROCESSES)]
    busy = [(token, generation.submit(_one_second_worker, token, "busy", "a", 5.0)) for token, _ in busy]
    deadline = time.monotonic() + 30
    while any(generation.started_at(token) is None for token, _ in busy):  # every child is busy for ~1 s
        assert time.monotonic() < deadline
        time.sleep(0.01)
    generation.last_sign_of_life = time.monotonic() - 1000.0  # and before that the pool was idle for long
    results = verify_batch([(f"o{i}", "a") for i in range(20)], worker=_tagging_worker)
    assert [(r.verified, r.extracted) for r in results] == [(True, f"tagged:o{i}:a") for i in range(20)]
    assert verify_mod._POOL.current() is generation  # not discarded as stalled
    for token, handle in busy:
        handle.wait(30)
        generation.forget(token)
