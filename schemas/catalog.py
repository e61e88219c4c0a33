"""The tables of this project, each declared once from its record (``schemas/tables.py`` says how).

Declared in the order the store lists them (``RUN_TABLES``: what ``Store.delete_run`` removes, in this order).
A table's migrations are the columns it gained after its first release, oldest first.
"""

from __future__ import annotations

from typing import Annotated, Any

import pandas as pd

from schemas.columns import NOT_NEGATIVE
from schemas.records import (
    AdapterVersion,
    DbMeta,
    Embedding,
    EvalComparison,
    EvalSample,
    EvalSummary,
    Experience,
    ExperienceStat,
    GateDecision,
    GateSample,
    GroupAdvantage,
    LessonTrial,
    LibraryAdoption,
    LibraryHead,
    LibraryQuality,
    LLMCall,
    OperationResult,
    Problem,
    Proposal,
    RefreshDecision,
    RefreshGateRow,
    RefreshInput,
    RefreshReject,
    RefreshWatermark,
    ReviewDecision,
    ReviewRequest,
    Reward,
    Rollout,
    RunRow,
    StageRun,
    Summary,
    TrialSample,
)
from schemas.tables import (
    TABLES,
    Computed,
    Table,
    added,
    declare,
    not_null_dropped,
    run_tables,
    stage_tables,
    unique_rows,
)

# what a sample (schemas.records.Sample) gained after its tables were first released: for trial and gate samples
# the fields evaluation samples had, and how it was drawn (its key, and whether this row drew it or reused it)
SAMPLE_KEY_COLUMNS = ("draw_key", "drawn")
SAMPLE_COLUMNS = ("judge_reason", "latency_s", "n_turns", "tool_calls", "tool_errors", *SAMPLE_KEY_COLUMNS)
# later still: which model drew a sample, and when (issue 59)
SAMPLE_IDENTITY_COLUMNS = ("model_identity", "drawn_at")


# whole-frame checks (a failure names the function)
def graded_or_explained(df: pd.DataFrame) -> bool:
    """A sample without a reward says why."""
    return not (df["reward"].isna() & df["error"].isna()).any()


def kept_trials_gained(df: pd.DataFrame) -> pd.Series:
    return (df["verdict"] != "kept") | df["gain"].notna()


def one_decision_per_step(df: pd.DataFrame) -> bool:
    return len(df) <= 1


def promoted_has_its_evidence(df: pd.DataFrame) -> pd.Series:
    """A promotion always names its candidate and the CI it passed."""
    promoted = df["status"] == "promoted"
    return ~promoted | (df["candidate_ref"].notna() & df["ci_low"].notna() & (df["ci_low"] > df["margin"]))


def verdicts_follow_the_rule(df: pd.DataFrame) -> pd.Series:
    """Overall: pass iff the CI lower bound is above the threshold. A gated tag: fail iff the CI upper
    bound is below it."""
    overall = df["tag"].isna()
    passes = (overall & (df["ci_low"] > df["threshold"])) | (~overall & (df["ci_high"] >= df["threshold"]))
    expected = passes.map({True: "pass", False: "fail"})
    return (df["verdict"] == expected) | (~overall & (df["verdict"] == "not_gated"))


def vector_has_dim_values(df: pd.DataFrame) -> bool:
    return bool((df["vector"].map(len) == df["dim"]).all())


def _position(record: Any, position: int) -> int:
    return position


RUN_ID: dict[str, Any] = {"run_id": str}

declare(Table("db_meta", DbMeta, key={}, primary_key=("key",)))
declare(
    Table(
        "runs",
        RunRow,
        key={},
        primary_key=("run_id",),
        migrations=(added("status", "updated_at", "error"), added("policy_identity")),
    )
)
declare(Table("stage_runs", StageRun, primary_key=("run_id", "step", "stage"), by_stage=False))
declare(
    Table(
        "problems",
        Problem,
        computed=(Computed("position", Annotated[int, NOT_NEGATIVE], _position),),
        migrations=(added("domain_tag", "tag", "answer_source"),),
        order="position",
    )
)
declare(
    Table(
        "rollouts",
        Rollout,
        computed=(Computed("final_text", str, lambda r, _: r.final_text, after="turns_json"),),
        migrations=(added("finish_reason", "n_turns", "tool_calls", "tool_errors", "tool_time_s"),),
        checks=(unique_rows("one_row_per_sample", "run_id", "step", "problem_id", "sample_idx"),),
        order="problem_id, sample_idx",
    )
)
declare(
    Table(
        "rewards",
        Reward,
        migrations=(added("verified", "judge_reason", "reward_source"), not_null_dropped("reward")),
        checks=(graded_or_explained,),
        order="problem_id, sample_idx",
    )
)
declare(Table("group_advantages", GroupAdvantage, order="problem_id"))
declare(Table("summaries", Summary, order="problem_id, sample_idx"))
declare(
    Table(
        "proposals",
        Proposal,
        computed=(Computed("n_operations", Annotated[int, NOT_NEGATIVE], lambda p, _: len(p.operations), "group_id"),),
        order="group_id",
    )
)
declare(Table("operations", OperationResult, flatten=("operation",), migrations=(added("example_json"),), order="seq"))
declare(
    Table(
        "llm_calls",
        LLMCall,
        migrations=(
            added("call_id", "finish_reason", "rate_limited", "final", "turn", "reply"),
            added("system_fingerprint"),
            added("waited_s"),
        ),
        order="started_at",
    )
)
declare(Table("evaluations", EvalSummary, order="created_at, condition"))
declare(
    Table(
        "eval_results",
        EvalSample,
        first=("condition",),
        migrations=(
            added("n_turns", "tool_calls", "tool_errors", "judge_reason", *SAMPLE_KEY_COLUMNS),
            added(*SAMPLE_IDENTITY_COLUMNS),
        ),
        checks=(unique_rows("one_row_per_sample", "condition", "problem_id", "sample_idx"),),
        order="condition, problem_id, sample_idx",
    )
)
declare(
    Table(
        "eval_comparisons",
        EvalComparison,
        migrations=(added("tag"),),  # NULL: over all problems (every row written before tags)
        checks=(unique_rows("one_row_per_comparison", "run_id", "step", "baseline", "candidate", "metric", "tag"),),
        order="baseline, candidate, tag NULLS FIRST, metric",
    )
)
declare(
    Table(
        "refresh_inputs",
        RefreshInput,
        migrations=(added("tag", "answer_source", "rejected_answer"),),
        order="position",
    )
)
declare(
    Table(
        "refreshes",
        RefreshDecision,
        migrations=(added("released"),),
        checks=(promoted_has_its_evidence,),
        order="refresh_date",
    )
)
declare(
    Table(
        "experience_stats",
        ExperienceStat,
        checks=(unique_rows("one_row_per_experience", "run_id", "step", "exp_id"),),
        order="exp_id",
    )
)
declare(Table("library_quality", LibraryQuality, migrations=(added("examples"),), order="version"))
declare(Table("lesson_trials", LessonTrial, checks=(kept_trials_gained,), order="seq"))
declare(
    Table(
        "trial_samples",
        TrialSample,
        first=("seq",),
        migrations=(added(*SAMPLE_COLUMNS), added(*SAMPLE_IDENTITY_COLUMNS)),
        checks=(unique_rows("one_row_per_sample", "seq", "problem_id", "sample_idx"),),
        order="seq, problem_id, sample_idx",
    )
)
declare(
    Table(
        "gate_samples",
        GateSample,
        first=("arm", "library_hash"),
        migrations=(added(*SAMPLE_COLUMNS), added(*SAMPLE_IDENTITY_COLUMNS)),
        checks=(unique_rows("one_row_per_sample", "arm", "problem_id", "sample_idx"),),
        order="arm, problem_id, sample_idx",
    )
)
declare(Table("library_gates", GateDecision, checks=(one_decision_per_step,), order="step"))
declare(
    Table(
        "refresh_gate",
        RefreshGateRow,
        checks=(
            unique_rows("one_row_per_tag", "run_id", "step", "tag", doc="One overall row (tag NULL) and one per tag."),
            verdicts_follow_the_rule,
        ),
        order="tag NULLS FIRST",
    )
)
declare(Table("refresh_rejects", RefreshReject, order="file, line"))
declare(Table("refresh_watermarks", RefreshWatermark, migrations=(added("n_late"),), order="name"))
declare(
    Table(
        "adapters",
        AdapterVersion,
        checks=(unique_rows("one_adapter_per_step", "run_id", "step"),),
        order="step",
    )
)
declare(Table("review_requests", ReviewRequest, order="refresh_id"))
declare(Table("review_decisions", ReviewDecision, order="length(change_id), change_id"))  # c2 before c10
declare(Table("library_adoptions", LibraryAdoption, order="seq"))
declare(
    Table(
        "library_versions",
        LibraryHead,
        key=RUN_ID,
        primary_key=("run_id", "version"),
    )
)
declare(
    Table(
        "library_experiences",
        Experience,
        key={**RUN_ID, "version": Annotated[int, NOT_NEGATIVE], "position": Annotated[int, NOT_NEGATIVE]},
        rename={"id": "exp_id"},
        migrations=(added("domain_tag"), added("example_json")),
    )
)
declare(Table("embeddings", Embedding, key={}, primary_key=("model", "text_hash"), checks=(vector_has_dim_values,)))

# Tables written through Store.write_stage, replaced as a unit by (run_id, step, stage).
STAGE_TABLES = stage_tables()
# Tables with a run_id column: everything `Store.delete_run` removes.
RUN_TABLES = run_tables()

__all__ = ["RUN_TABLES", "STAGE_TABLES", "TABLES"]  # TABLES: every declared table, ours first
