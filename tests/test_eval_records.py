"""Evaluation records: metrics from graded samples, and their round trip through the store."""

import json

import duckdb
import pytest

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.reports.report import comparison_table
from clgrpo.storage.store import FrameValidationError, Store
from schemas.config import DatasetConfig, EvalConfig, LearningConfig, LibraryGate, ModelConfig, RunConfig
from schemas.config_migrations import not_fingerprinted
from schemas.records import EvalSample, Problem, text_hash
from tasks.evaluate import compare_by_tag, compare_conditions, reward_matrix, sample_seeds, summarize_condition

CFG = EvalConfig(dataset=DatasetConfig(path="x.jsonl"), k=4, pass_k=2, bootstrap_samples=500)


def samples(condition: str, rewards: dict[str, list[float]]) -> list[EvalSample]:
    return [
        EvalSample(condition=condition, problem_id=pid, sample_idx=i, seed=100 + i, reward=r)
        for pid, rs in rewards.items()
        for i, r in enumerate(rs)
    ]


def test_summary_and_paired_comparison_from_graded_samples():
    base = samples("none", {"a": [1, 0, 0, 0], "b": [0, 0, 0, 0], "c": [1, 1, 0, 0]})
    better = samples("lib", {"a": [1, 1, 1, 0], "b": [1, 0, 0, 0], "c": [1, 1, 1, 1]})
    ids = ["a", "b", "c"]
    summary = summarize_condition(
        base,
        ids,
        CFG,
        eval_id="e",
        condition="none",
        library_ref="none",
        library=ExperienceLibrary(),
        dataset="x.jsonl",
        fingerprint="f",
        leaked_ids=["b", "z"],
    )
    assert summary.mean_at_k == pytest.approx(3 / 12)
    assert summary.pass_at_k == pytest.approx((0.5 + 0 + 5 / 6) / 3)  # unbiased pass@2 from 4 samples
    assert summary.mean_ci_low <= summary.mean_at_k <= summary.mean_ci_high
    assert summary.leaked_ids == ["b"] and summary.n_problems == 3 and summary.pass_k == 2
    mean_diff, pass_diff = compare_conditions(("none", base), ("lib", better), ids, CFG, eval_id="e")
    assert mean_diff.metric == "mean_at_k" and mean_diff.diff == pytest.approx(8 / 12 - 3 / 12)
    assert pass_diff.metric == "pass_at_k" and pass_diff.candidate_value == pytest.approx((1 + 0.5 + 1) / 3)


def test_comparisons_per_task_tag_reuse_the_overall_statistics(tmp_path):
    base = samples("none", {"a": [1, 0, 0, 0], "b": [0, 0, 0, 0], "c": [1, 1, 0, 0], "d": [0, 1, 0, 0]})
    better = samples("lib", {"a": [1, 1, 1, 0], "b": [1, 0, 0, 0], "c": [0, 0, 0, 0], "d": [1, 1, 1, 1]})
    problems = [
        Problem(problem_id=pid, problem=pid, tag=tag)
        for pid, tag in (("a", "sums"), ("b", "sums"), ("c", "geometry"), ("d", None))
    ]  # d: untagged, overall only
    comparisons = compare_by_tag(("none", base), ("lib", better), problems, CFG, eval_id="e")
    assert [(c.tag, c.metric, c.n_problems) for c in comparisons] == [
        (None, "mean_at_k", 4),
        (None, "pass_at_k", 4),
        ("geometry", "mean_at_k", 1),
        ("geometry", "pass_at_k", 1),
        ("sums", "mean_at_k", 2),
        ("sums", "pass_at_k", 2),
    ]
    assert comparisons[:2] == compare_conditions(("none", base), ("lib", better), list("abcd"), CFG, eval_id="e")
    sums = compare_conditions(("none", base), ("lib", better), ["a", "b"], CFG, eval_id="e", tag="sums")
    assert comparisons[4:] == sums and sums[0].diff == pytest.approx(4 / 8 - 1 / 8)
    geometry = comparisons[2]
    assert geometry.diff == pytest.approx(-0.5) and geometry.ci_low == geometry.ci_high == pytest.approx(-0.5)
    untagged = [p.model_copy(update={"tag": None}) for p in problems]
    assert compare_by_tag(("none", base), ("lib", better), untagged, CFG, eval_id="e") == comparisons[:2]

    summary = summarize_condition(
        base,
        list("abcd"),
        CFG,
        eval_id="e",
        condition="none",
        library_ref="none",
        library=ExperienceLibrary(),
        dataset="x",
        fingerprint="f",
    )
    headers, rows = comparison_table(comparisons, [summary])
    assert headers[:3] == ["candidate - baseline", "tag", "problems"]
    assert [row[1:4] for row in rows[::2]] == [
        ["all", "4", "Mean@4"],
        ["geometry", "1", "Mean@4"],
        ["sums", "2", "Mean@4"],
    ]
    assert "tag" not in comparison_table(comparisons[:2], [summary])[0]  # untagged: the table as before

    db = tmp_path / "db.duckdb"
    with Store(db) as store:
        store.write_stage("e", 0, "evaluate", {"eval_comparisons": comparisons})
        assert store.records("eval_comparisons", "e") == comparisons  # overall first, then tags by name
        with pytest.raises(FrameValidationError, match="one_row_per_comparison"):
            store.write_stage("e", 1, "evaluate", {"eval_comparisons": comparisons + comparisons[2:3]})


def test_comparisons_stored_before_task_tags_read_back_as_overall(tmp_path):
    """A file written before the tag column existed: opening it adds the column, its rows are overall rows."""
    db = tmp_path / "old.duckdb"
    base = samples("none", {"a": [1, 0, 0, 0]})
    comparisons = compare_conditions(("none", base), ("lib", base), ["a"], CFG, eval_id="old")
    with Store(db) as store:
        store.write_stage("old", 0, "evaluate", {"eval_comparisons": comparisons})
    with duckdb.connect(str(db)) as con:
        con.execute("ALTER TABLE eval_comparisons DROP COLUMN tag")
        con.execute("ALTER TABLE problems DROP COLUMN tag")
    with Store(db) as store:
        assert store.records("eval_comparisons", "old") == comparisons
        assert all(c.tag is None for c in comparisons)
        store.write_stage("p", 0, "select", {"problems": [Problem(problem_id="q", problem="q?", tag="sums")]})
        assert store.records("problems", "p")[0].tag == "sums"


def test_missing_samples_are_an_error_naming_them():
    partial = samples("none", {"a": [1, 0, 0, 0], "b": [0, 0]})
    with pytest.raises(ValueError, match=r"condition 'none': 2 of 8 samples missing \(b#2, b#3\)"):
        reward_matrix(partial, ["a", "b"], 4)


def test_seeds_depend_on_problem_and_evaluation_seed_only():
    problems = [Problem(problem_id=f"p{i}", problem=f"q{i}") for i in range(5)]
    assert sample_seeds(problems, 0) == sample_seeds(list(reversed(problems)), 0)
    assert sample_seeds(problems, 0) != sample_seeds(problems, 1)
    assert len(set(sample_seeds(problems, 0).values())) == 5


def by_content(record) -> str:
    return record.model_dump_json(exclude={"created_at"})


def test_evaluation_tables_round_trip_through_the_store(tmp_path):
    base = samples("none", {"a": [1, 0, 0, 0], "b": [0, 1, 0, 0]})
    lib = samples("lib", {"a": [1, 1, 0, 0], "b": [1, 1, 1, 0]})
    ids = ["a", "b"]
    summaries = [
        summarize_condition(
            s,
            ids,
            CFG,
            eval_id="ev",
            condition=c,
            library_ref=c,
            library=ExperienceLibrary(),
            dataset="x",
            fingerprint="f",
        )
        for c, s in (("none", base), ("lib", lib))
    ]
    comparisons = compare_conditions(("none", base), ("lib", lib), ids, CFG, eval_id="ev")
    outputs = {"evaluations": summaries, "eval_results": base + lib, "eval_comparisons": comparisons}
    with Store(tmp_path / "db.duckdb") as store:
        store.write_stage("ev", 0, "evaluate", outputs)
        store.write_stage("ev", 0, "evaluate", outputs)  # idempotent: replaced, not duplicated
        for table, records in outputs.items():  # read back in a stable order (conditions by name)
            assert sorted(store.records(table, "ev", 0, "evaluate"), key=by_content) == sorted(records, key=by_content)
        with pytest.raises(FrameValidationError, match="eval_results"):
            store.write_stage("ev", 1, "evaluate", {"eval_results": base + base})


def test_validation_and_max_steps_keep_fingerprints_of_runs_without_them():
    # the library gate was off by default before, and so were worked examples (until issue 57): a run made then
    # resumes by saying so, with its fingerprint
    cfg = RunConfig(
        dataset=DatasetConfig(path="t.jsonl"),
        learning=LearningConfig(library_gate=LibraryGate(enabled=False), examples="off"),
    )
    assert RunConfig(dataset=DatasetConfig(path="t.jsonl")).fingerprint() != cfg.fingerprint()  # now on: another run
    sections = (*not_fingerprinted(RunConfig), "rollout", "validation", "library", "judge", "hybrid", "domain_settings")
    excluded = (
        {key: True for key in sections}
        | {"grpo": {"max_steps": True}}
        | {
            "learning": {
                "min_words": True,
                "consolidation": True,
                "lesson_pattern": True,
                "max_ops_per_step": True,
                "guard": True,
                "max_learner_tokens": True,
                "extract": True,
                "candidates": True,
                "fallback": True,
                "summarize": True,
                "lesson_validation": True,
                "library_gate": True,
                "blocked": True,
                "unlabeled": True,
                "checks_budget": True,
                "examples": True,
                "rationalize_max": True,
            },
            "dataset": {
                "max_problem_chars": True,
                "max_answer_chars": True,
                "oversize": True,
                "domain_field": True,
                "url_field": True,
                "tag_field": True,
                "answer_source_field": True,
                "answers_optional": True,
            },
            # where and how the model is reached is not part of what a run computes
            "policy": {
                "repetition_penalty": True,
                "adapter": True,
                **{key: True for key in not_fingerprinted(ModelConfig)},
            },
        }
    )
    before_they_existed = cfg.model_dump(mode="json", exclude=excluded)
    assert cfg.fingerprint() == text_hash(json.dumps(before_they_existed, sort_keys=True))
    capped = RunConfig.model_validate({**cfg.model_dump(), "grpo": {"max_steps": 2}})
    assert capped.fingerprint() != cfg.fingerprint()
    with_validation = RunConfig.model_validate({**cfg.model_dump(), "validation": {"dataset": {"path": "v.jsonl"}}})
    assert with_validation.validation.temperature == 0.3 and with_validation.validation.k == 4
    assert with_validation.fingerprint() != cfg.fingerprint()
    assert RunConfig.model_validate_json(cfg.model_dump_json()).fingerprint() == cfg.fingerprint()
    with pytest.raises(ValueError, match="pass_k \\(5\\) must not exceed k \\(4\\)"):
        EvalConfig(dataset=DatasetConfig(path="x"), k=4, pass_k=5)
