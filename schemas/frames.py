"""pandera models, one per DuckDB table (same names and columns as ``schemas.ddl``).

The store validates every frame with its model before insert; a failure names the table, column and row.
"""

from __future__ import annotations

import pandas as pd
import pandera.pandas as pa
from pandera.typing import Series

from schemas.records import ANSWER_SOURCES, REWARD_SOURCES

_UTC = {"unit": "us", "tz": "UTC"}


class Frame(pa.DataFrameModel):
    class Config:
        coerce = True
        strict = True


class StageKeyed(Frame):
    run_id: Series[str] = pa.Field(str_length={"min_value": 1})
    step: Series[int] = pa.Field(ge=0)
    stage: Series[str] = pa.Field(str_length={"min_value": 1})


class RunsFrame(Frame):
    run_id: Series[str] = pa.Field(str_length={"min_value": 1}, unique=True)
    fingerprint: Series[str]
    config_json: Series[str]
    created_at: Series[pd.DatetimeTZDtype] = pa.Field(dtype_kwargs=_UTC)
    status: Series[str] = pa.Field(isin=["running", "completed", "failed", "budget_exhausted"], nullable=True)
    updated_at: Series[pd.DatetimeTZDtype] = pa.Field(dtype_kwargs=_UTC, nullable=True)
    error: Series[str] = pa.Field(nullable=True)


class StageRunsFrame(StageKeyed):
    n_rows: Series[int] = pa.Field(ge=0)
    completed_at: Series[pd.DatetimeTZDtype] = pa.Field(dtype_kwargs=_UTC)


class ProblemsFrame(StageKeyed):
    position: Series[int] = pa.Field(ge=0)
    problem_id: Series[str] = pa.Field(str_length={"min_value": 1}, unique=True)
    problem: Series[str] = pa.Field(str_length={"min_value": 1})
    answer: Series[str] = pa.Field(nullable=True)
    source: Series[str]
    domain_tag: Series[str] = pa.Field(nullable=True)
    tag: Series[str] = pa.Field(nullable=True)
    answer_source: Series[str] = pa.Field(isin=list(ANSWER_SOURCES), nullable=True)


class RolloutsFrame(StageKeyed):
    problem_id: Series[str]
    sample_idx: Series[int] = pa.Field(ge=0)
    prompt_hash: Series[str]
    library_version: Series[int] = pa.Field(ge=0)
    turns_json: Series[str]
    final_text: Series[str]
    tokens_in: Series[int] = pa.Field(ge=0)
    tokens_out: Series[int] = pa.Field(ge=0)
    latency_s: Series[float] = pa.Field(ge=0)
    error: Series[str] = pa.Field(nullable=True)
    finish_reason: Series[str] = pa.Field(nullable=True)
    n_turns: Series[pd.Int64Dtype] = pa.Field(ge=0, nullable=True)
    tool_calls: Series[pd.Int64Dtype] = pa.Field(ge=0, nullable=True)
    tool_errors: Series[pd.Int64Dtype] = pa.Field(ge=0, nullable=True)
    tool_time_s: Series[float] = pa.Field(ge=0, nullable=True)

    @pa.dataframe_check
    @classmethod
    def one_row_per_sample(cls, df: pd.DataFrame) -> bool:
        return not df.duplicated(["run_id", "step", "problem_id", "sample_idx"]).any()


class RewardsFrame(StageKeyed):
    problem_id: Series[str]
    sample_idx: Series[int] = pa.Field(ge=0)
    reward: Series[float] = pa.Field(ge=0.0, le=1.0, nullable=True)  # NULL: not graded (see error)
    extracted: Series[str] = pa.Field(nullable=True)
    error: Series[str] = pa.Field(nullable=True)
    verified: Series[bool] = pa.Field(nullable=True)
    judge_reason: Series[str] = pa.Field(nullable=True)
    reward_source: Series[str] = pa.Field(isin=list(REWARD_SOURCES), nullable=True)  # NULL: ungraded or older

    @pa.dataframe_check
    @classmethod
    def graded_or_explained(cls, df: pd.DataFrame) -> bool:
        """A sample without a reward says why."""
        return not (df["reward"].isna() & df["error"].isna()).any()


class GroupAdvantagesFrame(StageKeyed):
    problem_id: Series[str]
    rewards_json: Series[str]
    mean_reward: Series[float] = pa.Field(ge=0.0, le=1.0)
    std_reward: Series[float] = pa.Field(ge=0.0)
    advantages_json: Series[str]
    selected: Series[bool]
    reason: Series[str]


class SummariesFrame(StageKeyed):
    problem_id: Series[str]
    sample_idx: Series[int] = pa.Field(ge=0)
    text: Series[str]
    error: Series[str] = pa.Field(nullable=True)


class ProposalsFrame(StageKeyed):
    group_id: Series[str]
    n_operations: Series[int] = pa.Field(ge=0)
    operations_json: Series[str]
    raw_text: Series[str]
    parse_error: Series[str] = pa.Field(nullable=True)


class OperationsFrame(StageKeyed):
    seq: Series[int] = pa.Field(ge=0)
    op: Series[str] = pa.Field(isin=["add", "modify", "delete", "merge", "keep", "evict"])
    target_ids_json: Series[str]
    text: Series[str] = pa.Field(nullable=True)
    rationale: Series[str]
    source_groups_json: Series[str]
    status: Series[str] = pa.Field(isin=["applied", "rejected"])
    reason: Series[str]
    result_id: Series[str] = pa.Field(nullable=True)


class LLMCallsFrame(StageKeyed):
    role: Series[str] = pa.Field(isin=["policy", "learner"])
    model: Series[str]
    tokens_in: Series[int] = pa.Field(ge=0)
    tokens_out: Series[int] = pa.Field(ge=0)
    latency_s: Series[float] = pa.Field(ge=0)
    retries: Series[int] = pa.Field(ge=0)
    cost_usd: Series[float] = pa.Field(ge=0)
    ok: Series[bool]
    error: Series[str] = pa.Field(nullable=True)
    started_at: Series[pd.DatetimeTZDtype] = pa.Field(dtype_kwargs=_UTC)
    call_id: Series[str] = pa.Field(nullable=True)
    finish_reason: Series[str] = pa.Field(nullable=True)
    rate_limited: Series[bool] = pa.Field(nullable=True)
    final: Series[bool] = pa.Field(nullable=True)
    turn: Series[pd.Int64Dtype] = pa.Field(ge=0, nullable=True)
    reply: Series[str] = pa.Field(nullable=True)


class LessonTrialsFrame(StageKeyed):
    seq: Series[int] = pa.Field(ge=0, unique=True)
    operation_json: Series[str]
    problem_ids_json: Series[str]
    samples: Series[int] = pa.Field(ge=0)
    pairs: Series[int] = pa.Field(ge=0)
    mean_without: Series[float] = pa.Field(ge=0.0, le=1.0, nullable=True)
    mean_with: Series[float] = pa.Field(ge=0.0, le=1.0, nullable=True)
    gain: Series[float] = pa.Field(ge=-1.0, le=1.0, nullable=True)
    verdict: Series[str] = pa.Field(isin=["kept", "rejected", "untested"])
    reason: Series[str]

    @pa.dataframe_check
    @classmethod
    def kept_trials_gained(cls, df: pd.DataFrame) -> pd.Series:
        return (df["verdict"] != "kept") | df["gain"].notna()


class TrialSamplesFrame(StageKeyed):
    seq: Series[int] = pa.Field(ge=-1)
    problem_id: Series[str]
    sample_idx: Series[int] = pa.Field(ge=0)
    seed: Series[int]
    reward: Series[float] = pa.Field(ge=0.0, le=1.0, nullable=True)
    extracted: Series[str] = pa.Field(nullable=True)
    error: Series[str] = pa.Field(nullable=True)
    final_text: Series[str]
    tokens_in: Series[int] = pa.Field(ge=0)
    tokens_out: Series[int] = pa.Field(ge=0)
    judge_reason: Series[str] = pa.Field(nullable=True)
    latency_s: Series[float] = pa.Field(ge=0, nullable=True)
    n_turns: Series[pd.Int64Dtype] = pa.Field(ge=0, nullable=True)
    tool_calls: Series[pd.Int64Dtype] = pa.Field(ge=0, nullable=True)
    tool_errors: Series[pd.Int64Dtype] = pa.Field(ge=0, nullable=True)
    draw_key: Series[str] = pa.Field(nullable=True)
    drawn: Series[bool] = pa.Field(nullable=True)

    @pa.dataframe_check
    @classmethod
    def one_row_per_sample(cls, df: pd.DataFrame) -> bool:
        return not df.duplicated(["seq", "problem_id", "sample_idx"]).any()


class GateSamplesFrame(StageKeyed):
    arm: Series[str] = pa.Field(isin=["before", "after"])
    library_hash: Series[str]
    problem_id: Series[str]
    sample_idx: Series[int] = pa.Field(ge=0)
    seed: Series[int]
    reward: Series[float] = pa.Field(ge=0.0, le=1.0, nullable=True)
    extracted: Series[str] = pa.Field(nullable=True)
    error: Series[str] = pa.Field(nullable=True)
    final_text: Series[str]
    tokens_in: Series[int] = pa.Field(ge=0)
    tokens_out: Series[int] = pa.Field(ge=0)
    judge_reason: Series[str] = pa.Field(nullable=True)
    latency_s: Series[float] = pa.Field(ge=0, nullable=True)
    n_turns: Series[pd.Int64Dtype] = pa.Field(ge=0, nullable=True)
    tool_calls: Series[pd.Int64Dtype] = pa.Field(ge=0, nullable=True)
    tool_errors: Series[pd.Int64Dtype] = pa.Field(ge=0, nullable=True)
    draw_key: Series[str] = pa.Field(nullable=True)
    drawn: Series[bool] = pa.Field(nullable=True)

    @pa.dataframe_check
    @classmethod
    def one_row_per_sample(cls, df: pd.DataFrame) -> bool:
        return not df.duplicated(["arm", "problem_id", "sample_idx"]).any()


class LibraryGatesFrame(StageKeyed):
    verdict: Series[str] = pa.Field(isin=["adopted", "rejected", "unchanged"])
    reason: Series[str]
    rule: Series[str]
    problem_ids_json: Series[str]
    samples: Series[int] = pa.Field(ge=0)
    pairs: Series[int] = pa.Field(ge=0)
    before_hash: Series[str]
    after_hash: Series[str]
    mean_before: Series[float] = pa.Field(ge=0.0, le=1.0, nullable=True)
    mean_after: Series[float] = pa.Field(ge=0.0, le=1.0, nullable=True)
    diff: Series[float] = pa.Field(ge=-1.0, le=1.0, nullable=True)
    ci_low: Series[float] = pa.Field(ge=-1.0, le=1.0, nullable=True)
    ci_high: Series[float] = pa.Field(ge=-1.0, le=1.0, nullable=True)
    better_pairs: Series[int] = pa.Field(ge=0)
    worse_pairs: Series[int] = pa.Field(ge=0)
    p_better: Series[float] = pa.Field(ge=0.0, le=1.0, nullable=True)
    p_worse: Series[float] = pa.Field(ge=0.0, le=1.0, nullable=True)
    tags_json: Series[str]

    @pa.dataframe_check
    @classmethod
    def one_decision_per_step(cls, df: pd.DataFrame) -> bool:
        return len(df) <= 1


class LibraryVersionsFrame(Frame):
    run_id: Series[str]
    version: Series[int] = pa.Field(ge=0)
    step: Series[int] = pa.Field(ge=0)
    parent_version: Series[pd.Int64Dtype] = pa.Field(nullable=True)
    next_id: Series[int] = pa.Field(ge=0)
    id_prefix: Series[str]
    n_experiences: Series[int] = pa.Field(ge=0)
    content_hash: Series[str]
    retired_ids_json: Series[str]
    created_at: Series[pd.DatetimeTZDtype] = pa.Field(dtype_kwargs=_UTC)


class LibraryExperiencesFrame(Frame):
    run_id: Series[str]
    version: Series[int] = pa.Field(ge=0)
    position: Series[int] = pa.Field(ge=0)
    exp_id: Series[str] = pa.Field(str_length={"min_value": 1}, unique=True)
    text: Series[str] = pa.Field(str_length={"min_value": 1})
    created_step: Series[int] = pa.Field(ge=0)
    updated_step: Series[int] = pa.Field(ge=0)
    parent_ids_json: Series[str]
    source_groups_json: Series[str]
    domain_tag: Series[str] = pa.Field(nullable=True)


class EvaluationsFrame(StageKeyed):
    eval_id: Series[str] = pa.Field(str_length={"min_value": 1})
    condition: Series[str] = pa.Field(str_length={"min_value": 1}, unique=True)
    library_ref: Series[str]
    library_hash: Series[str]
    library_size: Series[int] = pa.Field(ge=0)
    dataset: Series[str]
    fingerprint: Series[str]
    n_problems: Series[int] = pa.Field(ge=1)
    k: Series[int] = pa.Field(ge=1)
    pass_k: Series[int] = pa.Field(ge=1)
    temperature: Series[float] = pa.Field(ge=0.0)
    seed: Series[int]
    ci_level: Series[float] = pa.Field(gt=0.0, lt=1.0)
    mean_at_k: Series[float] = pa.Field(ge=0.0, le=1.0)
    mean_ci_low: Series[float] = pa.Field(ge=0.0, le=1.0)
    mean_ci_high: Series[float] = pa.Field(ge=0.0, le=1.0)
    pass_at_k: Series[float] = pa.Field(ge=0.0, le=1.0)
    pass_ci_low: Series[float] = pa.Field(ge=0.0, le=1.0)
    pass_ci_high: Series[float] = pa.Field(ge=0.0, le=1.0)
    n_failed: Series[int] = pa.Field(ge=0)
    leaked_ids_json: Series[str]
    created_at: Series[pd.DatetimeTZDtype] = pa.Field(dtype_kwargs=_UTC)


class EvalResultsFrame(StageKeyed):
    condition: Series[str] = pa.Field(str_length={"min_value": 1})
    problem_id: Series[str]
    sample_idx: Series[int] = pa.Field(ge=0)
    seed: Series[int]
    reward: Series[float] = pa.Field(ge=0.0, le=1.0)
    extracted: Series[str] = pa.Field(nullable=True)
    error: Series[str] = pa.Field(nullable=True)
    final_text: Series[str]
    tokens_in: Series[int] = pa.Field(ge=0)
    tokens_out: Series[int] = pa.Field(ge=0)
    latency_s: Series[float] = pa.Field(ge=0)
    n_turns: Series[pd.Int64Dtype] = pa.Field(ge=0, nullable=True)
    tool_calls: Series[pd.Int64Dtype] = pa.Field(ge=0, nullable=True)
    tool_errors: Series[pd.Int64Dtype] = pa.Field(ge=0, nullable=True)
    judge_reason: Series[str] = pa.Field(nullable=True)
    draw_key: Series[str] = pa.Field(nullable=True)
    drawn: Series[bool] = pa.Field(nullable=True)

    @pa.dataframe_check
    @classmethod
    def one_row_per_sample(cls, df: pd.DataFrame) -> bool:
        return not df.duplicated(["condition", "problem_id", "sample_idx"]).any()


class EvalComparisonsFrame(StageKeyed):
    eval_id: Series[str] = pa.Field(str_length={"min_value": 1})
    baseline: Series[str]
    candidate: Series[str]
    metric: Series[str] = pa.Field(isin=["mean_at_k", "pass_at_k"])
    baseline_value: Series[float]
    candidate_value: Series[float]
    diff: Series[float] = pa.Field(ge=-1.0, le=1.0)
    ci_low: Series[float] = pa.Field(ge=-1.0, le=1.0)
    ci_high: Series[float] = pa.Field(ge=-1.0, le=1.0)
    ci_level: Series[float] = pa.Field(gt=0.0, lt=1.0)
    n_problems: Series[int] = pa.Field(ge=1)
    tag: Series[str] = pa.Field(nullable=True)  # NULL: all problems

    @pa.dataframe_check
    @classmethod
    def one_row_per_comparison(cls, df: pd.DataFrame) -> bool:
        return not df.duplicated(["run_id", "step", "baseline", "candidate", "metric", "tag"]).any()


class RefreshInputsFrame(StageKeyed):
    name: Series[str] = pa.Field(str_length={"min_value": 1})
    position: Series[int] = pa.Field(ge=0)
    problem_id: Series[str] = pa.Field(str_length={"min_value": 1}, unique=True)
    problem: Series[str] = pa.Field(str_length={"min_value": 1})
    answer: Series[str] = pa.Field(nullable=True)
    source: Series[str]
    arrived_at: Series[pd.DatetimeTZDtype] = pa.Field(dtype_kwargs=_UTC)
    problem_key: Series[str] = pa.Field(str_length={"min_value": 1}, unique=True)
    tag: Series[str] = pa.Field(nullable=True)
    answer_source: Series[str] = pa.Field(isin=list(ANSWER_SOURCES), nullable=True)
    rejected_answer: Series[str] = pa.Field(nullable=True)


class RefreshesFrame(StageKeyed):
    refresh_id: Series[str] = pa.Field(str_length={"min_value": 1}, unique=True)
    name: Series[str] = pa.Field(str_length={"min_value": 1})
    refresh_date: Series[str] = pa.Field(str_matches=r"^\d{4}-\d{2}-\d{2}$")
    cutoff: Series[pd.DatetimeTZDtype] = pa.Field(dtype_kwargs=_UTC)
    status: Series[str] = pa.Field(isin=["no_new_data", "promoted", "not_promoted"])
    n_new_problems: Series[int] = pa.Field(ge=0)
    baseline_ref: Series[str] = pa.Field(str_length={"min_value": 1})
    candidate_ref: Series[str] = pa.Field(nullable=True)
    train_run_id: Series[str] = pa.Field(nullable=True)
    eval_id: Series[str] = pa.Field(nullable=True)
    metric: Series[str] = pa.Field(isin=["mean_at_k", "pass_at_k"])
    baseline_value: Series[float] = pa.Field(nullable=True)
    candidate_value: Series[float] = pa.Field(nullable=True)
    diff: Series[float] = pa.Field(nullable=True, ge=-1.0, le=1.0)
    ci_low: Series[float] = pa.Field(nullable=True, ge=-1.0, le=1.0)
    ci_high: Series[float] = pa.Field(nullable=True, ge=-1.0, le=1.0)
    ci_level: Series[float] = pa.Field(nullable=True, gt=0.0, lt=1.0)
    margin: Series[float] = pa.Field(ge=-1.0, lt=1.0)
    reasons_json: Series[str]
    decided_at: Series[pd.DatetimeTZDtype] = pa.Field(dtype_kwargs=_UTC)
    released: Series[bool] = pa.Field(nullable=True)

    @pa.dataframe_check
    @classmethod
    def promoted_has_its_evidence(cls, df: pd.DataFrame) -> pd.Series:
        """A promotion always names its candidate and the CI it passed."""
        promoted = df["status"] == "promoted"
        return ~promoted | (df["candidate_ref"].notna() & df["ci_low"].notna() & (df["ci_low"] > df["margin"]))


class RefreshGateFrame(StageKeyed):
    refresh_id: Series[str] = pa.Field(str_length={"min_value": 1})
    tag: Series[str] = pa.Field(nullable=True)  # NULL: the overall row
    metric: Series[str] = pa.Field(isin=["mean_at_k", "pass_at_k"])
    n_problems: Series[int] = pa.Field(ge=1)
    baseline_value: Series[float] = pa.Field(ge=0.0, le=1.0)
    candidate_value: Series[float] = pa.Field(ge=0.0, le=1.0)
    diff: Series[float] = pa.Field(ge=-1.0, le=1.0)
    ci_low: Series[float] = pa.Field(ge=-1.0, le=1.0)
    ci_high: Series[float] = pa.Field(ge=-1.0, le=1.0)
    ci_level: Series[float] = pa.Field(gt=0.0, lt=1.0)
    threshold: Series[float] = pa.Field(ge=-1.0, le=1.0)
    verdict: Series[str] = pa.Field(isin=["pass", "fail", "not_gated"])
    reason: Series[str]

    @pa.dataframe_check
    @classmethod
    def one_row_per_tag(cls, df: pd.DataFrame) -> bool:
        """One overall row (tag NULL) and one per tag."""
        return not df.duplicated(["run_id", "step", "tag"]).any()

    @pa.dataframe_check
    @classmethod
    def verdicts_follow_the_rule(cls, df: pd.DataFrame) -> pd.Series:
        """Overall: pass iff the CI lower bound is above the threshold. A gated tag: fail iff the CI upper
        bound is below it."""
        overall = df["tag"].isna()
        passes = (overall & (df["ci_low"] > df["threshold"])) | (~overall & (df["ci_high"] >= df["threshold"]))
        expected = passes.map({True: "pass", False: "fail"})
        return (df["verdict"] == expected) | (~overall & (df["verdict"] == "not_gated"))


class RefreshRejectsFrame(StageKeyed):
    name: Series[str] = pa.Field(str_length={"min_value": 1})
    file: Series[str] = pa.Field(str_length={"min_value": 1})
    line: Series[int] = pa.Field(ge=0)
    reason: Series[str] = pa.Field(str_length={"min_value": 1})


class RefreshWatermarksFrame(StageKeyed):
    name: Series[str] = pa.Field(str_length={"min_value": 1}, unique=True)
    after: Series[pd.DatetimeTZDtype] = pa.Field(dtype_kwargs=_UTC, nullable=True)
    watermark: Series[pd.DatetimeTZDtype] = pa.Field(dtype_kwargs=_UTC, nullable=True)
    n_rows: Series[int] = pa.Field(ge=0)
    n_rejected: Series[int] = pa.Field(ge=0)
    n_redacted: Series[int] = pa.Field(ge=0)
    n_late: Series[pd.Int64Dtype] = pa.Field(ge=0, nullable=True)  # NULL: written before the column was added


class DbMetaFrame(Frame):
    key: Series[str] = pa.Field(unique=True)
    value: Series[str]


class LibraryQualityFrame(StageKeyed):
    version: Series[int] = pa.Field(ge=0)
    size: Series[int] = pa.Field(ge=0)
    tokens: Series[int] = pa.Field(ge=0)
    near_duplicates: Series[int] = pa.Field(ge=0)
    duplicate_ratio: Series[float] = pa.Field(ge=0)
    mean_confidence: Series[float] = pa.Field(ge=0, le=1, nullable=True)
    never_cited_share: Series[float] = pa.Field(ge=0, le=1, nullable=True)
    coverage: Series[float] = pa.Field(ge=0, le=1, nullable=True)
    coverage_problems: Series[int] = pa.Field(ge=0)
    added: Series[int] = pa.Field(ge=0)
    modified: Series[int] = pa.Field(ge=0)
    deleted: Series[int] = pa.Field(ge=0)
    evicted: Series[int] = pa.Field(ge=0)


class AdaptersFrame(StageKeyed):
    base_model: Series[str] = pa.Field(str_length={"min_value": 1})
    rank: Series[int] = pa.Field(ge=1)
    rows_used: Series[int] = pa.Field(ge=0)
    rows_skipped: Series[int] = pa.Field(ge=0)
    loss_before: Series[float] = pa.Field(nullable=True)
    loss_after: Series[float] = pa.Field(nullable=True)
    logprob_change_pos: Series[float] = pa.Field(nullable=True)
    logprob_change_neg: Series[float] = pa.Field(nullable=True)
    library_version: Series[int] = pa.Field(ge=0)
    parent_path: Series[str] = pa.Field(nullable=True)
    path: Series[str] = pa.Field(str_length={"min_value": 1})
    device: Series[str] = pa.Field(str_length={"min_value": 1})
    seconds: Series[float] = pa.Field(ge=0)
    created_at: Series[pd.DatetimeTZDtype] = pa.Field(dtype_kwargs=_UTC)

    @pa.dataframe_check
    @classmethod
    def one_adapter_per_step(cls, df: pd.DataFrame) -> bool:
        return not df.duplicated(["run_id", "step"]).any()


class ExperienceStatsFrame(StageKeyed):
    exp_id: Series[str] = pa.Field(str_length={"min_value": 1})
    cited: Series[int] = pa.Field(ge=0)
    cited_correct: Series[float] = pa.Field(ge=0)
    cited_wrong: Series[float] = pa.Field(ge=0)
    cited_in_variance: Series[int] = pa.Field(ge=0)
    confidence: Series[float] = pa.Field(ge=0, le=1)
    ci_low: Series[float] = pa.Field(ge=0, le=1)
    ci_high: Series[float] = pa.Field(ge=0, le=1)

    @pa.dataframe_check
    @classmethod
    def one_row_per_experience(cls, df: pd.DataFrame) -> bool:
        return not df.duplicated(["run_id", "step", "exp_id"]).any()


class EmbeddingsFrame(Frame):
    model: Series[str] = pa.Field(str_length={"min_value": 1})
    text_hash: Series[str] = pa.Field(str_length={"min_value": 1})
    dim: Series[int] = pa.Field(gt=0)
    vector: Series[object]
    created_at: Series[pd.DatetimeTZDtype] = pa.Field(dtype_kwargs=_UTC)

    @pa.dataframe_check
    @classmethod
    def vector_has_dim_values(cls, df: pd.DataFrame) -> bool:
        return bool((df["vector"].map(len) == df["dim"]).all())


class ReviewRequestsFrame(StageKeyed):
    refresh_id: Series[str] = pa.Field(str_length={"min_value": 1}, unique=True)
    name: Series[str] = pa.Field(str_length={"min_value": 1})
    flow_run_id: Series[str] = pa.Field(nullable=True)
    timeout_s: Series[int] = pa.Field(ge=1)
    deadline: Series[pd.DatetimeTZDtype] = pa.Field(dtype_kwargs=_UTC)
    changes_json: Series[str]
    pending_json: Series[str]
    config_json: Series[str]
    created_at: Series[pd.DatetimeTZDtype] = pa.Field(dtype_kwargs=_UTC)


class ReviewDecisionsFrame(StageKeyed):
    change_id: Series[str] = pa.Field(str_matches=r"^c\d+$", unique=True)
    op: Series[str] = pa.Field(isin=["add", "modify", "delete"])
    exp_id: Series[str] = pa.Field(str_length={"min_value": 1})
    before: Series[str] = pa.Field(nullable=True)
    proposed: Series[str] = pa.Field(nullable=True)
    after: Series[str] = pa.Field(nullable=True)
    decision: Series[str] = pa.Field(isin=["approve", "edit", "reject", "refused_edit", "timed_out"])
    adopted: Series[bool]
    reason: Series[str]
    reviewer: Series[str] = pa.Field(str_length={"min_value": 1})
    decided_at: Series[pd.DatetimeTZDtype] = pa.Field(dtype_kwargs=_UTC)


class LibraryAdoptionsFrame(StageKeyed):
    name: Series[str] = pa.Field(str_length={"min_value": 1})
    seq: Series[int] = pa.Field(ge=0)
    action: Series[str] = pa.Field(isin=["promote", "rollback"])
    version: Series[int] = pa.Field(ge=1)
    from_version: Series[pd.Int64Dtype] = pa.Field(nullable=True, ge=1)
    refresh_id: Series[str] = pa.Field(str_length={"min_value": 1})
    library_ref: Series[str] = pa.Field(str_length={"min_value": 1})
    content_hash: Series[str] = pa.Field(str_length={"min_value": 1})
    folder: Series[str] = pa.Field(str_length={"min_value": 1})
    actor: Series[str] = pa.Field(str_length={"min_value": 1})
    reason: Series[str]
    adopted_at: Series[pd.DatetimeTZDtype] = pa.Field(dtype_kwargs=_UTC)


FRAMES: dict[str, type[Frame]] = {
    "db_meta": DbMetaFrame,
    "runs": RunsFrame,
    "stage_runs": StageRunsFrame,
    "problems": ProblemsFrame,
    "rollouts": RolloutsFrame,
    "rewards": RewardsFrame,
    "group_advantages": GroupAdvantagesFrame,
    "summaries": SummariesFrame,
    "proposals": ProposalsFrame,
    "operations": OperationsFrame,
    "llm_calls": LLMCallsFrame,
    "library_versions": LibraryVersionsFrame,
    "library_experiences": LibraryExperiencesFrame,
    "embeddings": EmbeddingsFrame,
    "experience_stats": ExperienceStatsFrame,
    "lesson_trials": LessonTrialsFrame,
    "trial_samples": TrialSamplesFrame,
    "gate_samples": GateSamplesFrame,
    "library_gates": LibraryGatesFrame,
    "library_quality": LibraryQualityFrame,
    "evaluations": EvaluationsFrame,
    "eval_results": EvalResultsFrame,
    "eval_comparisons": EvalComparisonsFrame,
    "refresh_inputs": RefreshInputsFrame,
    "refreshes": RefreshesFrame,
    "refresh_gate": RefreshGateFrame,
    "refresh_rejects": RefreshRejectsFrame,
    "refresh_watermarks": RefreshWatermarksFrame,
    "review_requests": ReviewRequestsFrame,
    "review_decisions": ReviewDecisionsFrame,
    "library_adoptions": LibraryAdoptionsFrame,
    "adapters": AdaptersFrame,
}
