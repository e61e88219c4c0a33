"""Typed records exchanged between stages.

Every stage takes and returns these; each table of the store holds one of them (``schemas/catalog.py``), whose
columns, frame checks and mappers are derived from the record (``schemas/tables.py``).
Nested fields (turns, id lists) are plain Python lists here and JSON text in DuckDB.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from schemas.columns import DIFF, LEVEL, NOT_EMPTY, NOT_NEGATIVE, SHARE, UNIQUE, Check, PydanticJson, Sql


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def text_hash(text: str) -> str:
    """Short, stable content hash used for prompts, libraries and configs."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


# What a field's column checks beyond the record's own validation (``schemas.columns``; the table's frame applies
# them to every row written): counts and durations are never negative, names never empty, shares within [0, 1].
Count = Annotated[int, NOT_NEGATIVE]
Amount = Annotated[float, NOT_NEGATIVE]  # seconds, USD, a standard deviation
Share = Annotated[float, SHARE]
Diff = Annotated[float, DIFF]
Level = Annotated[float, LEVEL]
Name = Annotated[str, NOT_EMPTY]
Seed = Annotated[int, Sql("BIGINT")]


class Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# Where a refresh input's answer came from (a production trace's feedback, or none).
ANSWER_SOURCES = ("ground_truth", "reference", "correction", "thumbs_up_reply", "none")
# What graded a reward: the problem's answer (by its source), the LLM judge, or agreement among the group.
REWARD_SOURCES = (
    "ground_truth",
    "feedback:reference",
    "feedback:correction",
    "feedback:thumbs_up",
    "judge",
    "agreement",
)


class Problem(Record):
    problem_id: Annotated[str, UNIQUE] = Field(min_length=1)
    problem: str = Field(min_length=1)
    answer: str | None = None  # None when the dataset has no ground truth
    source: str = ""
    domain_tag: str | None = None  # the problem's domain in a mixed dataset (``dataset.domain_field``)
    # the problem's task tag (``dataset.tag_field``, or set by a refresh source): evaluations compare
    # conditions per tag too, and a refresh gates promotion on every tag (``clgrpo.refresh.promotion``)
    tag: str | None = None
    # where the answer came from: None (a dataset's ground truth) or one of ANSWER_SOURCES (refresh traces)
    answer_source: Annotated[str, Check(isin=list(ANSWER_SOURCES))] | None = None


class Turn(Record):
    """One element of a trajectory. Direct rollouts have a single assistant turn; agent rollouts interleave
    assistant text, tool calls (``content``: the arguments as JSON) and tool results (``content``: the output;
    ``error``: the tool's error line; ``truncated``: the output was cut at the sandbox's cap)."""

    kind: Literal["assistant", "tool_call", "tool_result"]
    content: str
    tool_name: str | None = None
    turn: int = 0  # the model call (0-based) this element belongs to
    call_id: str | None = None  # pairs a tool call with its result
    error: str | None = None  # tool_result: why the tool failed (the model saw it)
    truncated: bool = False  # tool_result: output cut; assistant: reply cut at max_tokens


class Rollout(Record):
    problem_id: str
    sample_idx: int = Field(ge=0)
    prompt_hash: str
    library_version: int = Field(ge=0)
    turns: list[Turn] = Field(default_factory=list)
    tokens_in: Count = 0
    tokens_out: Count = 0
    latency_s: Amount = 0.0
    error: str | None = None  # set when the policy call failed after its retries: not graded, not learned from
    # the endpoint's reason for stopping: "stop", or "length" when the reply was cut at max_tokens
    finish_reason: str = ""
    # agent rollouts: model calls made, tool calls and how many returned an error, seconds spent in tools
    n_turns: Count = 1
    tool_calls: Count = 0
    tool_errors: Count = 0
    tool_time_s: Amount = 0.0

    @property
    def truncated(self) -> bool:
        """Cut off at max_tokens: graded like any answer, but marked (the learner is told)."""
        return self.finish_reason == "length"

    @property
    def final_text(self) -> str:
        """The last assistant turn: what the verifier grades."""
        for turn in reversed(self.turns):
            if turn.kind == "assistant":
                return turn.content
        return ""


class Reward(Record):
    problem_id: str
    sample_idx: int = Field(ge=0)
    # None: not graded: the rollout failed, the problem has no ground truth, or the verifier could not do its
    # work (``error`` says which); never a 0 standing in for "unknown"
    reward: float | None = Field(ge=0.0, le=1.0)
    extracted: str | None = None
    error: str | None = None
    verified: bool = True  # False: the verifier could not grade this sample (a failed item of the verify stage)
    judge_reason: str | None = None  # graded by the LLM judge: its reason
    reward_source: Annotated[str, Check(isin=list(REWARD_SOURCES))] | None = (
        None  # what graded it (REWARD_SOURCES); None: not graded, or an older row
    )

    @property
    def graded(self) -> bool:
        return self.reward is not None


class GroupAdvantage(Record):
    """Numeric group-relative advantage, recorded for every group."""

    problem_id: str
    rewards: list[float | None]  # per sample; None: not graded (failed or unverifiable), left out of mean and std
    mean_reward: Share
    std_reward: Amount
    advantages: list[float | None]
    selected: bool  # goes on to the semantic stages
    reason: str  # why it was or was not selected


class NumericItem(Record):
    """One completion the numeric step learns from: its prompt rebuilt as the rollout built it (checked against
    the rollout's ``prompt_hash``), the stored completion text, and its group advantage."""

    problem_id: str
    sample_idx: int = Field(ge=0)
    messages: list[dict[str, str]]
    completion: str
    truncated: bool = False  # cut at max_tokens: no end-of-sequence token is appended
    advantage: float


class AdapterVersion(Record):
    """A LoRA adapter the numeric step saved after a training step (table ``adapters``, stage
    ``numeric_update``); versioned beside the library versions. ``logprob_change_*``: mean change of the mean
    token log-prob of the step's positive / negative-advantage completions (None: no such completion)."""

    base_model: Name  # the policy's identity (``clgrpo.llm.adapters.model_identity``): an adapter loads on it only
    rank: int = Field(ge=1)
    rows_used: int = Field(ge=0)
    rows_skipped: int = Field(0, ge=0)  # zero-advantage, failed, over max_rows, or prompt not reproducible
    loss_before: float | None = None
    loss_after: float | None = None
    logprob_change_pos: float | None = None
    logprob_change_neg: float | None = None
    library_version: int = Field(ge=0)  # the library the completions were sampled with
    parent_path: str | None = None  # the adapter this one continued from (None: a fresh LoRA)
    path: Name
    device: Name = "cpu"
    seconds: Amount = 0.0
    created_at: datetime = Field(default_factory=utcnow)


class Summary(Record):
    problem_id: str
    sample_idx: int = Field(ge=0)
    text: str
    error: str | None = None


class WorkedExample(Record):
    """What makes a library item an *example* rather than a lesson: a training problem whose solution (the item's
    ``text``) reaches its verified answer, shown to the policy as a solved problem. Provenance: the group it came
    from is the item's ``source_groups``; ``author`` the model that wrote the solution, ``reward`` what the
    verifier gave it, ``origin`` how it was obtained."""

    problem: str = Field(min_length=1)
    answer: str = Field(min_length=1)
    author: str = ""
    reward: Share = 1.0
    # "rollout": the policy's own correct attempt in a group whose rewards differ; "rationalized": written by the
    # learner with the reference answer in view, kept because the verifier accepted it; "file": imported
    origin: Literal["rollout", "rationalized", "file"] = "rollout"
    task_tag: str | None = None  # the problem's task tag: examples are shown to problems of the same tag first


class OpKind(StrEnum):
    ADD = "add"
    MODIFY = "modify"
    DELETE = "delete"
    MERGE = "merge"
    KEEP = "keep"
    EVICT = "evict"  # never proposed by the learner: the token budget's removals (``library.max_tokens``)


class Operation(Record):
    """An edit of the library. ``target_ids``: modify/delete/keep take one id, merge two or more, add none."""

    op: OpKind
    target_ids: list[str] = Field(default_factory=list)
    text: str | None = None
    rationale: str = ""
    source_groups: list[str] = Field(default_factory=list)
    example: WorkedExample | None = None  # an add of a worked example (``text``: its solution); None: a lesson

    @field_validator("target_ids", mode="before")
    @classmethod
    def _ids_as_strings(cls, value: object) -> object:
        if isinstance(value, (str, int)):
            value = [value]
        if isinstance(value, list):
            return [str(v).strip() for v in value]
        return value


class OpStatus(StrEnum):
    APPLIED = "applied"
    REJECTED = "rejected"


class OperationResult(Record):
    seq: Count  # position of the operation in its batch
    operation: Operation
    status: OpStatus
    reason: str = ""
    result_id: str | None = None  # id created or changed by an applied operation


class Proposal(Record):
    """The operations one group suggested (or, for consolidation, one chunk's plan)."""

    group_id: str  # problem id for group proposals; "chunk-N" / "final" for consolidation
    operations: list[Operation] = Field(default_factory=list)
    raw_text: str = ""
    parse_error: str | None = None  # set when the reply could not be parsed even after the repair re-ask


class LessonTrial(Record):
    """Lesson validation of one planned operation (stage ``validate_lessons``): its problems attempted without
    and with it on the same seeds, and the verdict. ``verdict``: kept, rejected (no gain, or a better candidate
    of its group), or untested (not a lesson text, or a worked example left to the library gate)."""

    seq: Annotated[int, UNIQUE] = Field(ge=0)  # position of the operation in the step's plan
    operation: Operation
    problem_ids: list[str] = Field(default_factory=list)
    samples: Count = 0  # per problem and arm
    pairs: Count = 0  # (problem, sample) pairs graded in both arms: what the means are over
    mean_without: Share | None = None
    mean_with: Share | None = None
    gain: Diff | None = None
    verdict: Literal["kept", "rejected", "untested"]
    reason: str = ""


class Sample(Record):
    """One graded answer of a library to a problem (``tasks.measure``): the one sample record of evaluation,
    lesson trials and the library gate, whose tables add only the role (condition, candidate, arm).
    ``draw_key``: what determined the draw (policy and sampling settings, rendered prompt, reference, seed); a
    later measurement with the same key reads this sample instead of drawing it again. ``drawn``: False when
    this row reuses a sample drawn earlier (its tokens were spent once, by the row that drew it). ``model_identity``
    and ``drawn_at``: which model drew it (``schemas.config.ModelIdentity.label``) and when; a row that reuses a
    sample carries the drawing row's (None: drawn before they were recorded, or without a preflight)."""

    problem_id: str
    sample_idx: int = Field(ge=0)
    seed: Seed
    reward: float | None = Field(None, ge=0.0, le=1.0)  # None: failed or not gradable (left out of the pairs)
    extracted: str | None = None
    error: str | None = None  # failed policy call or verifier error
    judge_reason: str | None = None  # graded by the LLM judge: its reason
    final_text: str = ""
    tokens_in: Count = 0
    tokens_out: Count = 0
    latency_s: Amount = 0.0
    n_turns: Count = 1  # agent rollouts: model calls, tool calls and tool errors
    tool_calls: Count = 0
    tool_errors: Count = 0
    draw_key: str | None = None  # None: stored before samples were keyed (never reused)
    drawn: bool = True
    model_identity: str | None = None
    drawn_at: datetime | None = None

    @property
    def reusable(self) -> bool:
        """Keyed and without error (a reward of None without one: a problem without ground truth, ungraded by
        design): a later measurement with its key may read it."""
        return self.draw_key is not None and self.error is None


class TrialSample(Sample):
    """One graded attempt of lesson validation: ``seq`` -1 is the library as it is (shared by every candidate of
    the step), else the plan's operation ``seq`` applied."""

    seq: int = Field(ge=-1)


class GateSample(Sample):
    """One graded attempt of the library gate: ``arm`` before (the library as it was) or after (the step's plan
    applied), ``library_hash`` the content it was shown."""

    arm: Literal["before", "after"]
    library_hash: str


class GateDecision(Record):
    """The library gate's verdict on one step (stage ``library_gate``): the paired comparison over the problems
    set aside, per task tag too, and whether the step's operations were adopted."""

    verdict: Literal["adopted", "rejected", "unchanged"]  # unchanged: the plan changes no lesson (nothing to gate)
    reason: str
    rule: str
    problem_ids: list[str] = Field(default_factory=list)
    samples: Count = 0
    pairs: Count = 0
    before_hash: str = ""
    after_hash: str = ""
    mean_before: Share | None = None
    mean_after: Share | None = None
    diff: Diff | None = None
    ci_low: Diff | None = None
    ci_high: Diff | None = None
    better_pairs: Count = 0  # pairs where the library after scored higher
    worse_pairs: Count = 0
    p_better: Share | None = None  # exact one-sided sign test
    p_worse: Share | None = None
    tags_json: str = "[]"  # per task tag: [{tag, problems, diff, better, worse, p_worse, verdict}]


class Experience(Record):
    id: Annotated[str, UNIQUE] = Field(min_length=1)
    text: str = Field(min_length=1)
    created_step: Count = 0
    updated_step: Count = 0
    parent_ids: list[str] = Field(default_factory=list)  # merged or modified-from ids
    source_groups: list[str] = Field(default_factory=list)  # groups (problem ids) that produced it
    domain_tag: str | None = None  # shown only to problems of this domain; None: shared by all domains
    example: WorkedExample | None = None  # a worked example (``text``: its solution); None: a lesson

    @property
    def kind(self) -> Literal["lesson", "example"]:
        return "lesson" if self.example is None else "example"


class ExperienceStat(Record):
    """How an experience fared up to a library version: attempts whose summaries cited it, by outcome, and a
    confidence (Beta posterior mean with a credible interval, ``clgrpo.experience.usefulness``)."""

    exp_id: Name
    cited: Count = 0
    cited_correct: Amount = 0.0  # sum of the rewards of the citing attempts
    cited_wrong: Amount = 0.0  # sum of 1 - reward
    cited_in_variance: Count = 0  # citations in groups with reward variance
    confidence: Share = 0.5
    ci_low: Share = 0.0
    ci_high: Share = 1.0


class LibraryQuality(Record):
    """The library after a step, as a whole (``clgrpo.experience.quality``): stored per version at the checkpoint."""

    version: int = Field(ge=0)
    size: int = Field(ge=0)  # live experiences
    examples: int | None = Field(None, ge=0)  # of them worked examples (None: stored before examples were counted)
    tokens: int = Field(ge=0)  # estimated tokens of the rendered lessons (``clgrpo.experience.tokens``)
    near_duplicates: int = Field(0, ge=0)  # adds / modifies of the step rejected or merged as near-duplicates
    duplicate_ratio: float = Field(0.0, ge=0)  # near_duplicates / adds and modifies applied or rejected
    mean_confidence: Share | None = None  # over live experiences (None: empty library)
    never_cited_share: Share | None = None  # live experiences no summary has cited yet
    coverage: Share | None = None  # share of the step's summarized problems whose attempts cited >= 1 lesson
    coverage_problems: int = Field(0, ge=0)  # the denominator: problems with summaries (groups with variance)
    added: int = Field(0, ge=0)  # churn, the step's applied operations: new ids (adds, merge results)
    modified: int = Field(0, ge=0)  # modified texts
    deleted: int = Field(0, ge=0)  # ids gone by delete or merge
    evicted: int = Field(0, ge=0)  # ids gone by the token budget


class LibraryVersion(Record):
    version: int = Field(ge=0)
    step: int = Field(ge=0)
    parent_version: int | None = None
    experiences: list[Experience] = Field(default_factory=list)
    retired_ids: list[str] = Field(default_factory=list)  # deleted or merged away; never reused
    next_id: int = Field(ge=0)
    id_prefix: str = "E"
    created_at: datetime = Field(default_factory=utcnow)
    # problem id -> the experience ids its rollout prompt shows (``clgrpo.experience.retrieval``); None: the whole
    # library. Travels to the rollout and summarize tasks with the version; never stored with it.
    shown: dict[str, list[str]] | None = None
    # how its worked examples are shown (``library.examples_shown``, ``library.examples_as``); never stored
    examples_shown: int = Field(2, ge=0)
    examples_as: Literal["turns", "block"] = "turns"


class LLMCall(Record):
    """One request sent to a model endpoint (an attempt): a call retried twice is three records with the same
    ``call_id`` and ``retries`` 0, 1, 2. ``error`` is this attempt's cause of failure."""

    stage: str
    role: Literal["policy", "learner"]
    model: str
    tokens_in: Count = 0
    tokens_out: Count = 0
    latency_s: Amount = 0.0
    retries: Count = 0  # retries before this attempt: 0 for a call's first request
    cost_usd: Amount = 0.0
    ok: bool = True
    error: str | None = None
    started_at: datetime = Field(default_factory=utcnow)  # when the attempt was made, before it waited its turn
    call_id: str = ""  # shared by the attempts of one call
    finish_reason: str = ""  # of the first choice, for a successful attempt
    rate_limited: bool = False  # this attempt was answered 429
    final: bool = True  # the call's last attempt (its outcome); False: an attempt that was retried
    turn: Count | None = None  # agent rollouts: the model call's turn (0-based) in its rollout
    # a learner call's reply text, usable or not (a policy reply is stored with its rollout)
    reply: str | None = None
    # what the provider said of the backend configuration that answered (OpenAI's system_fingerprint), if it did
    system_fingerprint: str | None = None
    # seconds from started_at until the request was sent (its turn under the client's concurrency limit): it
    # ended at started_at + waited_s + latency_s (None in rows stored before it was recorded)
    waited_s: Amount | None = 0.0


class EvalSample(Sample):
    """One graded evaluation sample: a condition's (library's) rollout of one problem."""

    condition: Name
    # the same seeds for every condition, so (problem, sample) pairs are matched across conditions; a failed
    # policy call or verifier error counts as reward 0
    reward: float = Field(ge=0.0, le=1.0)


class EvalSummary(Record):
    """One condition of an evaluation: Mean@k and Pass@k with bootstrap confidence intervals."""

    eval_id: Name
    condition: Annotated[str, NOT_EMPTY, UNIQUE]  # unique label within the evaluation
    library_ref: str  # "none", a library file, or RUN_ID:VERSION
    library_hash: str
    library_size: int = Field(ge=0)
    dataset: str
    fingerprint: str  # what was evaluated and how: a stored evaluation is reused only for the same one
    n_problems: int = Field(ge=1)
    k: int = Field(ge=1)
    pass_k: int = Field(ge=1)
    temperature: Amount
    seed: Seed
    ci_level: Level
    mean_at_k: Share
    mean_ci_low: Share
    mean_ci_high: Share
    pass_at_k: Share
    pass_ci_low: Share
    pass_ci_high: Share
    n_failed: int = Field(
        0, ge=0
    )  # samples whose policy call failed or that could not be verified (scored 0, counted here)
    leaked_ids: list[str] = Field(default_factory=list)  # evaluated problems that are also training problems
    created_at: datetime = Field(default_factory=utcnow)


class EvalComparison(Record):
    """The paired difference candidate - baseline on the same problems and per-sample seeds."""

    eval_id: Name
    baseline: str
    candidate: str
    metric: Literal["mean_at_k", "pass_at_k"]
    baseline_value: float
    candidate_value: float
    diff: Diff
    ci_low: Diff
    ci_high: Diff
    ci_level: Level
    n_problems: int = Field(ge=1)
    tag: str | None = None  # None: over all problems; else over the problems of this task tag (``Problem.tag``)

    @property
    def significant(self) -> bool:
        """The confidence interval of the difference excludes 0."""
        return self.ci_low > 0 or self.ci_high < 0


class RefreshInput(Record):
    """A new problem taken by a refresh: where it came from, when it arrived, and its content key (a problem
    is taken by one decided refresh only)."""

    name: Name  # the refresh (RefreshConfig.name)
    position: int = Field(ge=0)  # oldest first
    problem_id: Annotated[str, UNIQUE] = Field(min_length=1)
    problem: str = Field(min_length=1)
    answer: str | None = None
    source: str  # file name or table
    arrived_at: datetime
    problem_key: Annotated[str, NOT_EMPTY, UNIQUE]  # hash of the normalized problem text
    tag: str | None = None
    answer_source: Annotated[str, Check(isin=list(ANSWER_SOURCES))] | None = (
        None  # ANSWER_SOURCES; None: a dataset row's answer field
    )
    rejected_answer: str | None = None  # a trace's thumbs-down answer: known wrong (kept, not used in grading)

    def to_problem(self) -> Problem:
        return Problem(
            problem_id=self.problem_id,
            problem=self.problem,
            answer=self.answer,
            source=self.source,
            tag=self.tag,
            answer_source=self.answer_source,
        )


class RefreshReject(Record):
    """A source row a refresh skipped, and why (``file:line: reason``)."""

    name: Name
    file: Name
    line: int = Field(ge=0)  # 1-based line of a JSONL file; a table's row number (0-based)
    reason: Name

    def render(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


class RefreshWatermark(Record):
    """What a traces refresh read: rows that arrived after ``after`` up to ``watermark`` (the next refresh
    starts after it), how many were skipped as malformed and how many secrets were redacted."""

    name: Annotated[str, NOT_EMPTY, UNIQUE]
    after: datetime | None = None  # the previous decided refresh's watermark; None: the first
    watermark: datetime | None = None  # None: nothing arrived (the next refresh starts after ``after``)
    n_rows: int = Field(0, ge=0)
    n_rejected: int = Field(0, ge=0)
    n_redacted: int = Field(0, ge=0)
    n_late: int = Field(0, ge=0)  # rows taken though logged with a time before ``after`` (out of order)


class RefreshGateRow(Record):
    """One row of a refresh's promotion gate (``clgrpo.refresh.promotion``; table ``refresh_gate``): the paired
    comparison baseline -> candidate over all held-out problems (``tag`` None) or over one task tag's, and its verdict.
    Overall: pass when the CI lower bound is above ``threshold`` (the margin). A tag: fail when the CI upper
    bound is below ``threshold`` (-tag_margin), not_gated when it has fewer than ``min_tag_problems``."""

    refresh_id: Name
    tag: str | None = None  # None: all held-out problems
    metric: Literal["mean_at_k", "pass_at_k"]
    n_problems: int = Field(ge=1)
    baseline_value: Share
    candidate_value: Share
    diff: Diff
    ci_low: Diff
    ci_high: Diff
    ci_level: Level
    threshold: Diff
    verdict: Literal["pass", "fail", "not_gated"]
    reason: str


class RefreshDecision(Record):
    """What one refresh decided and why. ``status``: no_new_data (nothing trained), promoted, or
    not_promoted (candidate kept out; ``reasons`` say why). awaiting_review is never stored: what a refresh
    returns while its changes wait for a person (``review: required``)."""

    refresh_id: Annotated[str, NOT_EMPTY, UNIQUE]
    name: Name
    refresh_date: Annotated[
        str, Check(str_matches=r"^\d{4}-\d{2}-\d{2}$")
    ]  # YYYY-MM-DD in the refresh's timezone: one refresh per name and date
    cutoff: datetime  # problems that arrived up to this instant were considered
    # awaiting_review is never stored
    status: Annotated[
        Literal["no_new_data", "promoted", "not_promoted", "awaiting_review"],
        Check(isin=["no_new_data", "promoted", "not_promoted"]),
    ]
    n_new_problems: int = Field(ge=0)
    baseline_ref: Name  # the promoted library the refresh started from ("none", a file, or RUN_ID:VERSION)
    candidate_ref: str | None = None  # RUN_ID:VERSION of the trained library
    train_run_id: str | None = None
    eval_id: str | None = None
    metric: Literal["mean_at_k", "pass_at_k"]
    baseline_value: float | None = None
    candidate_value: float | None = None
    diff: Diff | None = None
    ci_low: Diff | None = None
    ci_high: Diff | None = None
    ci_level: Level | None = None
    margin: Annotated[float, Check(ge=-1.0, lt=1.0)]
    reasons: list[str] = Field(default_factory=list)
    decided_at: datetime = Field(default_factory=utcnow)
    released: bool = False  # its problems go back to the next refresh (its review timed out)

    @property
    def promoted(self) -> bool:
        return self.status == "promoted"


# --- human review and adoption of a refresh's library ----------------------------------------------------------
class LessonChange(Record):
    """One change a refresh's candidate makes to the promoted library, as a reviewer sees it: ``change_id``
    (``c1``, ``c2``...), the lesson it touches, its text before (baseline) and as proposed (candidate), and
    where it came from (training operations, their source problems) and how it fared (trials, citations)."""

    change_id: str = Field(pattern=r"^c\d+$")
    op: Literal["add", "modify", "delete"]
    exp_id: str = Field(min_length=1)
    before: str | None = None
    proposed: str | None = None
    source_groups: list[str] = Field(default_factory=list)  # the problems whose groups produced it
    origin: list[str] = Field(default_factory=list)  # the training operations that made it, one line each
    evidence: list[str] = Field(default_factory=list)  # validation trials and citation statistics, if stored


class ReviewRequest(Record):
    """A refresh's changes waiting for a person: stored before the flow suspends (or, outside a deployment,
    before it returns ``awaiting_review``); ``pending`` is the decision it would record if every change were
    approved. ``flow_run_id``: the suspended Prefect flow run (None: a terminal refresh)."""

    refresh_id: Annotated[str, NOT_EMPTY, UNIQUE]
    name: Name
    flow_run_id: str | None = None
    timeout_s: int = Field(ge=1)
    deadline: datetime
    changes: list[LessonChange]
    pending: Annotated[RefreshDecision, PydanticJson()]
    config_json: str  # the RefreshConfig, so `clgrpo review` can finish a terminal refresh
    created_at: datetime = Field(default_factory=utcnow)


class ReviewDecision(Record):
    """A reviewer's answer for one change and what it did: ``after`` is the lesson text promoted (None: the
    change was not adopted, or a delete was); ``reason`` is the reviewer's, or the guard's for a refused edit."""

    change_id: Annotated[str, UNIQUE, Check(str_matches=r"^c\d+$")]
    op: Literal["add", "modify", "delete"]
    exp_id: Name
    before: str | None = None
    proposed: str | None = None
    after: str | None = None
    decision: Literal["approve", "edit", "reject", "refused_edit", "timed_out"]
    adopted: bool
    reason: str = ""
    reviewer: Name
    decided_at: datetime = Field(default_factory=utcnow)


class LibraryAdoption(Record):
    """One change of the library that serving reads (the refresh's exported ``promoted.json``): a promotion
    (a new ``version``) or a rollback (back to an earlier ``version``)."""

    name: Name  # the refresh name (RefreshConfig.name)
    seq: int = Field(ge=0)  # order of events of this name
    action: Literal["promote", "rollback"]
    version: int = Field(ge=1)  # the version now in place
    from_version: Annotated[int, Check(ge=1)] | None = (
        None  # the version it replaced (None: nothing was promoted before)
    )
    refresh_id: Name  # the refresh that produced the version now in place
    library_ref: Name  # RUN_ID:VERSION in DuckDB
    content_hash: Name
    folder: Name  # where the served files and backups are
    actor: Name
    reason: str = ""
    adopted_at: datetime = Field(default_factory=utcnow)


# --- rows the store keeps itself (no stage writes them) -----------------------------------------------------------
class DbMeta(Record):
    """One row: this database's identity (a uuid made when the file is created); work journals and anything else
    kept outside the file are keyed by it, so a new or re-created database never picks up stale work."""

    key: Annotated[str, UNIQUE]
    value: str


class RunRow(Record):
    """A run: its ``RunConfig`` as JSON with its fingerprint, and its status (``Store.register_run``)."""

    run_id: Annotated[str, NOT_EMPTY, UNIQUE]
    fingerprint: str
    config_json: str
    created_at: datetime
    status: Literal["running", "completed", "failed", "budget_exhausted"] | None = None
    updated_at: datetime | None = None
    error: str | None = None
    # the policy's identity the run is bound to (``schemas.config.ModelIdentity.to_json``): a resume against another
    # is refused unless the user accepts it. None: stored before identities existed (bound at its next resume)
    policy_identity: str | None = None


class StageRun(Record):
    """The store's marker of a stored stage (``Store.write_stage``): a stage is done when it has one."""

    n_rows: int = Field(ge=0)
    completed_at: datetime


class LibraryHead(Record):
    """A library version without its lessons (rows of ``library_experiences``): what ``Store.save_library``
    stores of a ``LibraryVersion`` besides them."""

    version: int = Field(ge=0)
    step: int = Field(ge=0)
    parent_version: int | None = None
    next_id: int = Field(ge=0)
    id_prefix: str
    n_experiences: int = Field(ge=0)
    content_hash: str
    retired_ids: list[str] = Field(default_factory=list)
    created_at: datetime


class Embedding(Record):
    """The embedding of a text (lessons, operation texts), computed once per text and model and shared by all
    runs of a file."""

    model: str = Field(min_length=1)
    text_hash: str = Field(min_length=1)
    dim: int = Field(gt=0)
    vector: Annotated[list[float], Sql("FLOAT[]")]
    created_at: datetime
