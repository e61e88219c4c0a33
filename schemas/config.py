"""The typed run configuration: one pydantic tree, loadable from YAML, usable as Prefect flow parameters.

Layers: ``RunConfig`` (base: run id, storage, domain, dataset, models) holds a ``GRPOConfig`` (group size,
sampling, epochs, batches) and a ``LearningConfig`` (library limits, operations, ground truth). The nightly
refresh's own config, which holds a run config as its training template, is ``schemas.refresh_config``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.config_migrations import (
    NOT_FINGERPRINTED,
    CountsWhen,
    FingerprintedAs,
    FingerprintedBy,
    Inlined,
    NotFingerprinted,
    fingerprint_payload,
    migrate,
)
from schemas.domain_settings import DomainSettings as DomainSettings  # a domain's settings derive from it
from schemas.domain_settings import domain_settings_model, read_domain_settings
from schemas.records import text_hash


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PriceTable(Section):
    """USD per million tokens."""

    input_per_mtok: float = 0.0
    output_per_mtok: float = 0.0


# --- pieces several sections share, declared once -------------------------------------------------------------
Seconds = Annotated[float, Field(gt=0)]
Count = Annotated[int, Field(ge=0)]
Delay = Annotated[float, Field(ge=0)]
# how long a request may take and how it is retried or waits: never what it computes
Timeout = Annotated[Seconds, NOT_FINGERPRINTED]
Tries = Annotated[Count, NOT_FINGERPRINTED]
Wait = Annotated[Delay, NOT_FINGERPRINTED]


class Endpoint(Section):
    """An OpenAI-compatible endpoint: where it is and where its key comes from (read at call time, never stored)."""

    base_url: Annotated[str | None, NOT_FINGERPRINTED] = None  # None: the SDK default (api.openai.com)
    api_key_env: Annotated[str | None, NOT_FINGERPRINTED] = "OPENAI_API_KEY"
    api_key_secret_block: Annotated[str | None, NOT_FINGERPRINTED] = None  # Prefect Secret block, if env is unset


class Retries(Section):
    """How long one request may take, and how its transient errors (5xx, timeouts, resets, malformed replies) are
    retried: at most ``max_retries`` times, backing off from ``retry_base_delay_s`` (doubling, with jitter) up to
    ``retry_max_delay_s`` (``clgrpo.models.retry``). A section with other defaults declares only the defaults."""

    timeout_s: Timeout = 120.0
    max_retries: Tries = 6
    retry_base_delay_s: Wait = 1.0
    retry_max_delay_s: Wait = 60.0


class PoolPlacement(Section):
    """Where GPU work runs: in the flow's process (``local``) or as child flow runs of ``deployment`` on the CUDA
    work pool (``pool``), handing results back through ``handoff_storage``: a local path shared with the GPU
    workers or any fsspec URL (s3://..., gs://...); None: <db dir>/<run_id>/handoff. Never changes results."""

    placement: Annotated[Literal["local", "pool"], NOT_FINGERPRINTED] = "local"
    deployment: Annotated[str, NOT_FINGERPRINTED]  # each section using a pool names its deployment
    handoff_storage: Annotated[str | None, NOT_FINGERPRINTED] = None
    timeout_s: Timeout = 3600.0  # per child run
    poll_interval_s: Timeout = 2.0


class ServedModel(Section):
    """What an endpoint states of the model it serves, read once at the preflight (``tasks.preflight``): the fields
    of its ``GET /models`` entry that describe the weights (llama-server's ``meta``: parameter count, file size,
    vocabulary; vLLM's ``root``), or a local backend's weights hash. Empty ``fields``: it states nothing of them."""

    source: str = ""  # where it was read: "GET /models", "weights"
    fields: dict[str, Any] = Field(default_factory=dict)


IDENTITY_LABEL_CHARS = 240  # the longest a model identity is written in one line


@dataclass(frozen=True)
class ModelIdentity:
    """Which model answers: its configured name, what its endpoint states of it (``ServedModel``) and the
    ``revision`` a user sets where the endpoint says nothing useful. ``key`` decides what stored samples and
    evaluations are reused and whether a run resumes; ``checked`` False: the endpoint was not asked (a flow run
    without its preflight): nothing is known beyond the config."""

    model: str
    fields: dict[str, Any] = field(default_factory=dict)
    revision: str | None = None
    checked: bool = True

    @property
    def key(self) -> str | None:
        """What is known of the model beyond its name, hashed; None when nothing is (the name is the identity, as
        for samples stored before identities existed)."""
        if not self.fields and self.revision is None:
            return None
        return text_hash(json.dumps({"fields": self.fields, "revision": self.revision}, sort_keys=True))

    @property
    def label(self) -> str:
        """``'local' [3f2a9c1d: meta.n_params=494032768, meta.size=397808896]``, or ``'local' (the endpoint
        states nothing more of it)``: one line naming the identity."""
        key = self.key
        if key is None:
            return f"{self.model!r} (the endpoint states nothing more of it)"
        parts = [f"{name}={value}" for name, value in _flat(self.fields)]
        if self.revision is not None:
            parts.append(f"revision={self.revision}")
        text = ", ".join(parts)
        if len(text) > IDENTITY_LABEL_CHARS:
            text = text[: IDENTITY_LABEL_CHARS - 3] + "..."
        return f"{self.model!r} [{key[:8]}: {text}]"

    def to_json(self) -> str:
        return json.dumps({"model": self.model, "fields": self.fields, "revision": self.revision}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelIdentity:
        data = json.loads(text)
        return cls(str(data.get("model", "")), dict(data.get("fields") or {}), data.get("revision"))


def _flat(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """``{"meta": {"size": 1}}`` -> ``[("meta.size", 1)]``, sorted by name."""
    if isinstance(value, dict):
        return [pair for name in sorted(value) for pair in _flat(value[name], f"{prefix}{name}.")]
    return [(prefix.rstrip("."), value)]


class ModelConfig(Endpoint, Retries):
    # openai: any OpenAI-compatible endpoint; transformers / vllm: an in-process engine on this machine
    backend: Literal["openai", "transformers", "vllm"] = "openai"
    model: str = "deepseek-chat"  # the name in records; for local backends also the weights when model_path is unset
    # the endpoint (openai): base_url, api_key_env, api_key_secret_block; the retries: timeout_s, max_retries,
    # retry_base_delay_s, retry_max_delay_s (from Endpoint and Retries)
    temperature: float = Field(0.7, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # >1 makes tokens already generated less likely (CTRL-style); curbs loops in small models. Not part of the
    # OpenAI API: sent as an extra field that vLLM / SGLang / llama.cpp servers read and others ignore
    repetition_penalty: float | None = Field(None, ge=1.0, le=2.0)
    max_tokens: int = Field(2048, ge=1)
    # rate limits (429) are retried by time, not counted as errors: for up to this long from a call's first 429,
    # honouring Retry-After, with every caller paused during the window
    max_rate_limit_wait_s: Wait = 600.0
    supports_n: bool = True  # request G samples with n=G; False: G separate calls
    json_schema: bool = True  # request response_format=json_schema; False: prompt + tolerant parser
    # what a model costs and how a local one batches do not change what it draws (evaluations and sample keys
    # leave them out); run fingerprints have carried them from the first release and keep them
    price: Annotated[PriceTable, NotFingerprinted(kept_by_runs=True)] = Field(default_factory=PriceTable)
    seed: int | None = None
    # local backends (transformers, vllm) only
    model_path: str | None = None  # HF folder, .gguf file (transformers), "embedded" (SmolLM2 cache) or hub id (vllm)
    device: str = "auto"  # auto: cuda > mps > cpu; or cpu, cuda, cuda:1, mps
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16/fp16 on GPUs, fp32 on CPU
    # torch threads on CPU; None: the cores not busy at load time
    cpu_threads: Annotated[int | None, Field(ge=1), NotFingerprinted(kept_by_runs=True)] = None
    # sequences per batched generate call; None: backend default
    max_batch_rows: Annotated[int | None, Field(ge=1), NotFingerprinted(kept_by_runs=True)] = None
    engine_options: dict[str, Any] = Field(default_factory=dict)  # extra vllm.LLM(...) arguments
    # a LoRA adapter on top of the weights (transformers: peft; vllm: LoRARequest): a folder with
    # adapter_model.safetensors, or RUN_ID:STEP / RUN_ID:latest (an adapter the numeric step stored)
    adapter: str | None = None
    # the weights' revision as the user knows it, where the endpoint states nothing useful of them (a re-quantized
    # file under the same name, a provider's rolling model name): part of the model's identity (``identity``),
    # which is compared on its own (``Store.bind_identity``), not fingerprinted
    revision: Annotated[str | None, NOT_FINGERPRINTED] = None
    # what the endpoint states of its model, set at the preflight (``tasks.preflight``), never by hand
    served: Annotated[ServedModel | None, NOT_FINGERPRINTED] = None

    def identity(self) -> ModelIdentity:
        """The model's identity as known now: the name, what the endpoint stated at the preflight, the revision."""
        fields = dict(self.served.fields) if self.served is not None else {}
        return ModelIdentity(self.model, fields, self.revision, checked=self.served is not None)


class DatasetConfig(Section):
    path: str | None = None  # local .jsonl / .json / .csv / .parquet
    hf_name: str | None = None  # optional Hugging Face `datasets` name (needs network or a local cache)
    hf_split: str = "train"
    hf_config: str | None = None
    id_field: str | None = "id"  # None or a missing column: ids are derived from the row number
    # a mixed dataset: the column naming each problem's domain (e.g. "algebra", "web"); a problem's prompt gets its
    # domain's experiences and the shared ones, and lessons learned from one domain's problems are tagged with it
    domain_field: str | None = None
    # the column with each problem's task tag (e.g. "geometry"): evaluations also compare conditions per tag and
    # a refresh gates on every tag; a missing column or a blank cell: untagged
    tag_field: str | None = "tag"
    # the column saying where each answer came from (``Problem.answer_source``; a refresh's traces)
    answer_source_field: str | None = None
    answers_optional: bool = False  # True: a missing answer is no ground truth for that problem, not an error
    # the web domain: the column with a question's start page (WebWalkerQA: root_url); added to the question as
    # "Start page: URL"; a missing or blank cell: no start page
    url_field: str | None = None
    problem_field: str = "problem"
    answer_field: str | None = "answer"  # None: no ground truth in this dataset
    limit: int | None = Field(None, ge=1)
    shuffle: bool = True
    seed: int = 0
    # input limits: a problem or answer longer than this is refused at load ("error": one line naming file,
    # row and size; "skip": left out and reported)
    max_problem_chars: int = Field(20_000, ge=1)
    max_answer_chars: int = Field(1_000, ge=1)
    oversize: Literal["error", "skip"] = "error"

    @model_validator(mode="after")
    def _one_source(self) -> "DatasetConfig":
        if (self.path is None) == (self.hf_name is None):
            raise ValueError("dataset: set exactly one of `path` (local file) or `hf_name` (Hugging Face dataset)")
        return self


class EmbeddingConfig(Endpoint, Retries):
    """Which embedding model (``clgrpo.models.embeddings``): the embedded all-MiniLM-L6-v2 (offline once fetched), any
    OpenAI-compatible ``/v1/embeddings`` endpoint, or a local sentence-embedding folder."""

    backend: Literal["embedded", "openai", "transformers"] = "embedded"
    model: str = "all-MiniLM-L6-v2"  # openai: the model name sent; local backends: a label only
    # openai: the endpoint (base_url, api_key_env, api_key_secret_block) and its retries (per batch; 429 is one of
    # their transient errors here): shorter than a model's
    timeout_s: Timeout = 60.0
    max_retries: Tries = 4
    retry_base_delay_s: Wait = 0.5
    retry_max_delay_s: Wait = 30.0
    dimensions: int | None = Field(None, ge=1)  # openai: ask for shorter vectors (text-embedding-3-*)
    model_path: str | None = None  # transformers: a local sentence-embedding folder
    batch_size: Annotated[int, Field(ge=1), NOT_FINGERPRINTED] = 32  # texts per forward pass / per request
    max_seq_length: int | None = Field(None, ge=8)  # local: truncate longer texts; None: the folder's setting
    # local: torch threads; None: the cores not busy at load time
    cpu_threads: Annotated[int | None, Field(ge=1), NOT_FINGERPRINTED] = None


class LibraryConfig(Section):
    """How the library is kept beyond the learner's own operations."""

    # near-duplicate control: an add or modify whose text is within ``near_duplicate_similarity`` (cosine of
    # embeddings) of a live experience is rejected (the reason names the id and the similarity), or with
    # "merge" an add is merged into that experience (its text kept, the sources joined); "off": exact
    # duplicates only (always refused)
    near_duplicates: Literal["off", "reject", "merge"] = "off"
    near_duplicate_similarity: Annotated[
        float,
        Field(gt=0.0, le=1.0),
        CountsWhen(lambda library: library.near_duplicates != "off"),
        FingerprintedAs("similarity"),
    ] = 0.9
    # what a rollout prompt gets: "all" the (domain's) experiences, identical for every problem (best for prefix
    # caching), or the "top_k" most similar to the problem (embeddings) plus the ``pinned`` ids
    injection: Literal["all", "top_k"] = "all"
    top_k: Annotated[int, Field(ge=1), CountsWhen(lambda library: library.injection != "all")] = 8
    # ids always shown with top_k (if live)
    pinned: Annotated[list[str], CountsWhen(lambda library: library.injection != "all")] = Field(default_factory=list)
    # a hard budget on the whole rendered library (estimated tokens, ``clgrpo.experience.tokens``): after each step's
    # operations, the least useful experiences are evicted (``evict`` operations) until it fits
    max_tokens: int | None = Field(None, ge=1)
    # which model embeds (not where it is served or how fast) counts when embeddings are used
    embedding: Annotated[EmbeddingConfig, CountsWhen(lambda library: library.uses_embeddings)] = Field(
        default_factory=EmbeddingConfig
    )
    # worked examples (library items that are solved problems): at most ``examples_shown`` in a prompt, those of
    # the problem's task tag first, then the most similar problems (word overlap), never the problem's own; shown
    # as earlier exchanges of the conversation ("turns") or as a block after the lessons ("block")
    examples_shown: int = Field(2, ge=0)
    examples_as: Literal["turns", "block"] = "turns"

    @property
    def uses_embeddings(self) -> bool:
        return self.near_duplicates != "off" or self.injection == "top_k"


class GRPOConfig(Section):
    group_size: int = Field(5, ge=1)
    epochs: int = Field(3, ge=1)
    batch_size: int = Field(100, ge=1)  # problems per step
    rollout_temperature: float = Field(0.7, ge=0.0, le=2.0)
    rollout_chunk_size: int = Field(16, ge=1)  # problems per rollout task run
    max_steps: int | None = Field(None, ge=1)  # stop after this many steps (None: all epochs x batches)


class LessonValidation(Section):
    """Lesson validation (stage ``validate_lessons``): before an add, modify or merge is applied, problems are
    attempted ``samples`` times without it (the library as it is) and with it (the operation applied as it would
    be, near-duplicate merge included), on the same seeds. Among the candidates of one group only the best is
    kept. Its calls are recorded and count against the budget like every other.

    ``trials_on``: ``sources_first``: the candidate's source problems, then other problems of the step (mixed
    rewards first), ``problems`` in all; ``others``: only training problems other than its sources, of its task
    tag (the step's with mixed rewards first, then the rest of the training set), so a lesson must help where it
    was not learned: its source problems alone measure memorisation.

    ``test``: ``mean``: kept if the mean reward rises by more than ``min_gain``, else rejected with the numbers.
    ``sign``: a sequential exact sign test over the (problem, sample) pairs that differ: ``problems`` more problems
    per look, up to ``max_problems``; after each look the candidate is kept when the test says better at level
    ``alpha`` / looks (Bonferroni over the looks), rejected as harmful when it says worse, and rejected as "no
    effect" when the last look decides nothing (a tie or a lucky pair never keeps it)."""

    enabled: bool = False
    samples: int = Field(4, ge=1)  # per problem and arm (without / with the lesson)
    problems: int = Field(3, ge=1)  # per candidate (sign test: per look)
    min_gain: float = Field(0.0, ge=-1.0, le=1.0)  # test mean: kept if mean(with) - mean(without) > min_gain
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None: grpo.rollout_temperature
    trials_on: Literal["sources_first", "others"] = "sources_first"
    test: Literal["mean", "sign"] = "mean"
    max_problems: int | None = Field(None, ge=1)  # test sign: problems at most (None: ``problems``, one look)
    alpha: float = Field(0.05, gt=0.0, lt=0.5)  # test sign: the one-sided level over all looks
    # near-duplicate candidates of a step form a cluster (tasks.candidate_clusters): its members are tried one
    # after another, best-rated first, until one is kept, at most this many
    cluster_tries: int = Field(3, ge=1)
    # which candidates are tried first when the checks budget cannot try them all (learning.checks_budget):
    # ``support``: those more groups proposed first (a cluster counts the groups of all its members), then the
    # plan's order (measured on `ranges`: benchmarks/REPORT.md); ``plan``: in the plan's order
    order: Literal["plan", "support"] = "support"

    @property
    def looks(self) -> int:
        """How many times the sign test looks (each after ``problems`` more problems)."""
        return max(1, -(-(self.max_problems or self.problems) // self.problems)) if self.test == "sign" else 1


class LibraryGate(Section):
    """The library gate (stage ``library_gate``): a step's changes are adopted only if they make the policy
    measurably better and no task tag worse. A share of the training problems (per task tag, at least
    ``min_problems``) is set aside when the run starts and never learned from: no rollout, lesson or trial of
    training uses it. At the end of each step the library before and the library after the step's operations
    answer those problems ``samples`` times each on the same seeds (paired); the mean reward's difference comes
    with a paired-bootstrap CI and an exact sign test over the pairs that differ. ``rule`` ``significant``: adopt
    only if the mean rises by more than ``min_gain`` and the sign test says better at ``adopt_alpha`` (one-sided);
    ``better``: a rise is enough (a change inside the noise gets in). Either way no task tag with at least
    ``min_problems`` gate problems may be worse beyond noise (its sign test at ``alpha``). A step not adopted
    keeps the library as it was, its operations stored as rejected with the numbers, and a run that adopts
    nothing ends with the library it started with, saying so. A library's samples are drawn once
    (``tasks.measure``): the one a step starts from was measured by the step that adopted it.

    ``enabled``: ``auto`` (the default): on where the training set allows it, that is for task tags of at least
    twice ``min_problems`` problems (smaller tags are learned from whole and not gated); a run where no tag is
    that large says the gate is off and why. ``true``: on, and a training set too small for it is an error.
    ``false``: off, which the run states."""

    enabled: bool | Literal["auto"] = "auto"
    share: float = Field(0.3, gt=0.0, lt=1.0)  # of each tag's training problems
    min_problems: int = Field(4, ge=1)
    samples: int = Field(4, ge=1)  # per problem and arm, at most
    # sequential: the samples are drawn in this many equal parts; after each, a step is adopted (or found worse
    # on a tag) at adopt_alpha (alpha) divided by the looks, else the next part is drawn; the last look decides
    looks: int = Field(2, ge=1)
    rule: Literal["better", "significant"] = "significant"
    min_gain: float = Field(0.0, ge=0.0, le=1.0)
    adopt_alpha: float = Field(0.2, gt=0.0, lt=0.5)  # rule significant: one-sided level of "better"
    alpha: float = Field(0.05, gt=0.0, lt=0.5)  # one-sided level of "worse beyond noise" (per tag)
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None: grpo.rollout_temperature


class BlockedLesson(Section):
    """A lesson a person rejected: an add, modify or merge that says (nearly) the same is rejected with ``reason``
    (a refresh fills these from its reviews, ``remember_rejected_nights``)."""

    text: str = Field(min_length=1)
    reason: str


class LearningConfig(Section):
    """How the learner turns attempts into library edits, and what a lesson may be."""

    use_groundtruth: bool = True
    # problems without an answer: "compare": ungraded, the learner compares the attempts on their own;
    # "agreement": the answer most of the group's usable rollouts give (more than half) is the reference
    unlabeled: Literal["compare", "agreement"] = "compare"
    min_words: int = Field(5, ge=1)  # a lesson is a sentence: shorter texts ("...", "Check.") are rejected
    max_words: int = Field(32, ge=1)
    # a regular expression every lesson must match (whole text): enforced by constrained decoding where the
    # learner's backend enforces JSON schemas, and checked when operations are applied. None: any sentence.
    lesson_pattern: str | None = None
    max_ops_per_group: int = Field(3, ge=1)  # operations one group proposal may carry; the rest are rejected
    max_ops_per_step: int = Field(30, ge=1)  # operations one step may apply; the rest are rejected
    max_library_size: int | None = Field(100, ge=1)  # live experiences; None: unlimited
    # the lesson guard: "standard" rejects instruction overrides, role impersonation, requests for references
    # or answers, answer literals, copied problem text and non-prose payloads; "strict" also imperative
    # address of the model ("you must ...") and any digits-only claims; "off" keeps only the length/id rules
    guard: Literal["off", "standard", "strict"] = "standard"
    max_learner_tokens: int = Field(2048, ge=16)  # learner replies are short JSON: a cap on the learner's max_tokens
    # llm: a learner call turns all group proposals into one plan; passthrough: the group proposals are the plan,
    # after de-duplication (as the reference implementation lets adds through unless merged)
    consolidation: Literal["llm", "passthrough"] = "llm"
    # how a group's lessons are asked for: "operations": the group's attempts (their summaries and trajectories)
    # and a JSON edit list; "contrast": one correct and one wrong attempt side by side, the step where they part
    # and one lesson per ask (what small learners manage)
    extract: Literal["operations", "contrast"] = "operations"
    candidates: int = Field(1, ge=1, le=8)  # contrast asks per group (other attempt pairs, other draws)
    # an operations reply with no usable operation (empty, unparseable, or every one copying the prompt) gets
    # contrast asks instead ("contrast"), or is kept as it is ("none")
    fallback: Literal["none", "contrast"] = "none"
    summarize: bool = True  # the per-rollout summaries (False: the stage runs and stores none, saying so)
    # worked examples as candidates beside lessons (a training problem with a solution that reaches its verified
    # answer, shown to the policy as a solved problem): "off"; "rollouts": from each group whose rewards differ,
    # its correct attempt the group advantage favours (the shortest of the best), kept whole; "rationalize":
    # those, and for up to ``rationalize_max`` groups with no right answer whose problem has a reference, a
    # solution the learner writes with the answer in view (stage ``rationalize``), kept only if the verifier
    # accepts its final answer; the library gate is their trial. Default since issue 57 (config_migrations);
    # "off" in agent mode unless set (``RunConfig._agents_learn_lessons``: an agent's example would show its
    # final answer without the tool calls that found it)
    examples: Literal["off", "rollouts", "rationalize"] = "rationalize"
    rationalize_max: int = Field(6, ge=1)
    lesson_validation: LessonValidation = Field(default_factory=LessonValidation)
    library_gate: LibraryGate = Field(default_factory=LibraryGate)
    # what a step's checks (lesson trials, with their shortening and clustering calls, and the library gate) may
    # spend, as a multiple of the step's own tokens (rollouts and learner calls): a step with its checks costs at
    # most 1 + this times the same step without them. The gate's looks are reserved first; a trial that does not
    # fit is rejected untried and a gate look that does not fit is not drawn, each saying so
    # (``tasks.checks_budget``). None: no limit. It shapes nothing while no check runs.
    checks_budget: Annotated[float | None, Field(gt=0.0), CountsWhen(lambda learning: learning.checks_run)] = 1.0
    blocked: list[BlockedLesson] = Field(default_factory=list)  # lessons not to learn again (rejected by a person)

    @field_validator("lesson_pattern")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"lesson_pattern {value!r} is not a regular expression: {exc}") from exc
        return value

    consolidate_chunk_size: int = Field(20, ge=2)  # proposals per consolidation call before a final pass
    summarize_chunk_size: int = Field(16, ge=1)  # groups per summarize / advantage task run

    @model_validator(mode="after")
    def _candidates_need_validation(self) -> "LearningConfig":
        if self.candidates > 1 and not self.lesson_validation.enabled:
            raise ValueError(
                "learning.candidates > 1 needs learning.lesson_validation.enabled: true (validation "
                "chooses among a group's candidates; without it every one would be applied)"
            )
        return self

    def asks_contrast(self) -> bool:
        return self.extract == "contrast" or self.fallback == "contrast"

    @property
    def checks_run(self) -> bool:
        """Lesson trials or the library gate may run."""
        return self.lesson_validation.enabled or self.library_gate.enabled is not False


class SandboxConfig(Section):
    """The sandboxed Python tool of agent rollouts (``clgrpo.sandbox.pool``): one interpreter per rollout, in its own
    process, started with a clean environment in a fresh temporary directory, with no network and no access to
    files outside that directory and the Python installation. Limits are per call; a call that exceeds the
    CPU-time or memory limit gets a tool error, one that exceeds the wall-time limit kills the interpreter (its
    variables are lost, the next call starts a fresh one)."""

    # interpreters alive at once: one per agent rollout from its first call to its end (its variables live
    # there), so rollouts beyond it wait; ~15 MB each when idle. Keep it near the agent rollouts in flight.
    pool_size: Annotated[int, Field(ge=1), NOT_FINGERPRINTED] = 64
    # interpreters started ahead, so a rollout's first call does not wait
    spares: Annotated[int, Field(ge=0), NOT_FINGERPRINTED] = 2
    cpu_s: float = Field(10.0, gt=0)  # CPU seconds per call
    wall_s: float = Field(30.0, gt=0)  # wall-clock seconds per call
    memory_mb: int = Field(1024, ge=128)  # address space of one interpreter
    output_chars: int = Field(20_000, ge=100)  # stdout + stderr kept per call (the rest is counted, not kept)
    max_file_mb: int = Field(64, ge=1)  # largest file a call may write in its temporary directory


class JudgeConfig(Section):
    """An LLM judge (``tasks/judge.py``) grades free-text final answers against the reference, with the learner
    model (stage ``verify``, accounted like any call); problems without ground truth are not judged."""

    temperature: float = Field(0.0, ge=0.0, le=2.0)


class AgentConfig(Section):
    """Agent rollouts: a ReAct loop over the one LLM client. Each turn is one model call; a reply with a tool
    call runs the tool and feeds its result back, a reply without one is the final answer. The last turn
    (``max_turns``) is asked for the final answer without tools."""

    max_turns: int = Field(6, ge=1)  # model calls per rollout, the last one answers
    # tools: OpenAI tool calling (``tools`` in the request); text: a fenced ```python block or a <tool> tag in
    # the reply (docs/agent.md); auto: tools for the openai backend (falling back to text when the
    # endpoint refuses ``tools``), text for the local engines
    protocol: Literal["auto", "tools", "text"] = "auto"
    turn_timeout_s: float = Field(600.0, gt=0)  # one turn: the model's reply (retries included) and its tools
    rollout_timeout_s: float = Field(1800.0, gt=0)  # a whole rollout; beyond it the rollout fails (not graded)
    tool_result_chars: int = Field(2_000, ge=100)  # of a tool result shown to the model (stored in full)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)


class RolloutPlacement(PoolPlacement):
    """How rollouts are made (``mode``: direct answers or an agent with tools) and where they run: in the
    training flow's process, or as child flow runs of the ``rollout-gpu`` deployment on the CUDA work pool.
    Placement never changes results; ``mode`` and the agent's limits do (they are part of the fingerprint)."""

    # the mode is fingerprinted as the agent's settings, which count in agent mode only
    mode: Annotated[Literal["direct", "agent"], NOT_FINGERPRINTED] = "direct"
    agent: Annotated[AgentConfig, CountsWhen(lambda rollout: rollout.mode == "agent")] = Field(
        default_factory=AgentConfig
    )
    # with placement, handoff_storage, timeout_s, poll_interval_s
    deployment: Annotated[str, NOT_FINGERPRINTED] = "rollout-gpu/rollout-gpu"

    def agent_settings(self) -> AgentConfig | None:
        """The agent's settings in agent mode, None for direct rollouts."""
        return self.agent if self.mode == "agent" else None


class HybridConfig(PoolPlacement):
    """Hybrid learning: after verify, a numeric GRPO step (stage ``numeric_update``) trains a LoRA adapter of the
    local transformers policy on the step's stored completions and group advantages (``clgrpo.models.hybrid``). Off by
    default; where it runs (``placement``, the pool's deployment and hand-off) never changes results."""

    enabled: bool = False
    rank: int = Field(8, ge=1)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | None = None  # None: peft's default for the architecture (q_proj, v_proj, ...)
    lr: float = Field(1e-4, gt=0)
    epochs: int = Field(1, ge=1)  # passes over the step's completions
    batch_rows: int = Field(8, ge=1)  # completions per optimizer step
    clip_eps: float = Field(0.2, gt=0.0, lt=1.0)  # PPO/GRPO ratio clip
    kl_coef: float = Field(0.0, ge=0.0)  # KL to the frozen base (adapter disabled); 0: no reference pass
    max_rows: int = Field(256, ge=1)  # completions used per step (non-zero advantage, in problem order)
    seed: int = 0
    # sample each step's rollouts with the latest adapter (on-policy, one adapted copy of the policy loaded);
    # False: every step samples with the policy as configured (the updates are then off-policy)
    rollout_adapter: bool = True
    # recompute activations in the backward pass: SmolLM2-135M, 4 x 345 tokens on CPU: peak RSS 4.6 -> 3.0 GB,
    # +17% time; on an H100 (0.5B shape, 64 rows) +9% time, 34 instead of 56 GiB (benchmarks/REPORT.md "GPU").
    # "auto": on for CPU, on CUDA only when the activations' estimate exceeds half the free GPU memory (decided
    # and logged per step). The same gradients either way, so not part of the fingerprint
    gradient_checkpointing: Annotated[bool | Literal["auto"], NOT_FINGERPRINTED] = "auto"
    # placement pool: this deployment on the cuda pool
    deployment: Annotated[str, NOT_FINGERPRINTED] = "numeric-update-gpu/numeric-update-gpu"


class EvalConfig(Section):
    """Evaluating a library on a dataset: k samples per problem at the evaluation temperature, which is its
    own setting (never the training temperature). Every condition gets the same per-(problem, sample) seeds."""

    dataset: DatasetConfig
    k: int = Field(8, ge=1)  # samples per problem: Mean@k
    pass_k: int | None = Field(None, ge=1)  # k of Pass@k, at most k (None: k); unbiased estimator when < k
    temperature: float = Field(0.3, ge=0.0, le=2.0)
    seed: int = 0
    bootstrap_samples: int = Field(2000, ge=100)
    ci_level: float = Field(0.95, gt=0.5, lt=1.0)
    resample_samples: bool = False  # two-level bootstrap: also resample the samples within each problem
    chunk_size: int = Field(16, ge=1)  # problems per evaluation task run
    leakage_threshold: float = Field(0.8, gt=0.0, le=1.0)  # character 5-gram Jaccard of a near-duplicate
    refuse_on_leakage: bool = False  # True: a problem shared with the training set stops the run

    @model_validator(mode="after")
    def _pass_k_at_most_k(self) -> "EvalConfig":
        if self.pass_k is not None and self.pass_k > self.k:
            raise ValueError(f"pass_k ({self.pass_k}) must not exceed k ({self.k}), the samples per problem")
        return self

    @property
    def pass_at(self) -> int:
        return self.pass_k or self.k


class ValidationConfig(EvalConfig):
    """Held-out evaluation during training: at step 0 (the baseline), every N steps and at the last step."""

    k: int = Field(4, ge=1)
    every_n_steps: int = Field(1, ge=1)


class StageTolerances(Section):
    """The fraction of a stage's items that may fail (a call that failed after its retries, a sample the
    verifier could not grade) with the stage still stored as done; beyond it the stage fails and a retry redoes
    only its failed items. Below it, failures are stored, counted in the step record and shown as warnings."""

    rollout: float = Field(0.1, ge=0.0, le=1.0)
    verify: float = Field(0.1, ge=0.0, le=1.0)
    summarize: float = Field(0.0, ge=0.0, le=1.0)
    group_advantage: float = Field(0.0, ge=0.0, le=1.0)
    rationalize: float = Field(0.2, ge=0.0, le=1.0)  # worked-example writer calls that failed after their retries
    consolidate: float = Field(0.0, ge=0.0, le=1.0)
    validation: float = Field(0.1, ge=0.0, le=1.0)  # held-out validation samples (stage "validate")
    validate_lessons: float = Field(0.1, ge=0.0, le=1.0)  # lesson validation attempts that could not be graded
    library_gate: float = Field(0.1, ge=0.0, le=1.0)  # library gate attempts that could not be graded


class BudgetConfig(Section):
    """Spending limits of a run, checked before each stage from the recorded calls (``llm_calls``): when one is
    reached the run stops after the current stage with a checkpoint and status ``budget_exhausted``; resuming
    with a larger budget continues. None: no limit."""

    max_tokens: int | None = Field(None, ge=1)  # input + output tokens of every model request
    max_usd: float | None = Field(None, gt=0)  # from the models' price tables


class ToleranceConfig(Section):
    max_failed_fraction: StageTolerances = Field(default_factory=StageTolerances)

    def of(self, setting: str) -> float:
        """The fraction of items that may fail under ``max_failed_fraction.<setting>`` (a stage's failure rule
        names its setting); 0 for a setting that does not exist (a stage added from outside)."""
        return float(getattr(self.max_failed_fraction, setting, 0.0))


# A model's identity (the revision, what the endpoint states) is compared on its own, in one line naming both
# (``Store.bind_identity``); sample keys and evaluations hash it apart from the model's settings.
IDENTITY_FIELDS = {"revision", "served"}


RUN_ID_PATTERN = r"^[A-Za-z0-9_.-]+$"


def _domain_settings_into(run: RunConfig, payload: dict[str, Any]) -> None:
    """The domain's settings, read and fingerprinted by the model it declares (``DomainSettings``)."""
    if run.domain_settings:
        settings = read_domain_settings(run.domain, run.domain_settings, domain_settings_model(run.domain))
        if settings is not None:
            settings.fingerprint_into(payload)


def _mode_of(rollout: Any) -> Any:
    """``rollout.mode`` of a run config's input, given as a mapping or as the section (absent: direct)."""
    return rollout.get("mode") if isinstance(rollout, dict) else getattr(rollout, "mode", "direct")


class RunConfig(Section):
    run_id: str | None = Field(None, pattern=RUN_ID_PATTERN)  # None: generated when the run starts, and printed
    # where a run keeps its data, how fast it goes, when it stops, what it draws afterwards: never what it computes
    db_path: Annotated[str, NOT_FINGERPRINTED] = "runs/clgrpo.duckdb"
    domain: str = "math"
    dataset: DatasetConfig
    policy: ModelConfig = Field(default_factory=ModelConfig)
    learner: ModelConfig | None = None  # None: the policy model also learns
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    learning: LearningConfig = Field(default_factory=LearningConfig)
    concurrency: Annotated[int, Field(ge=1), NOT_FINGERPRINTED] = 32  # in-flight LLM requests, all stages together
    # a group's summaries and advantage start once its own rollouts are verified (no batch-wide barrier);
    # same results as stage by stage (see benchmarks/REPORT.md)
    pipeline: Annotated[bool, NOT_FINGERPRINTED] = True
    # at the end of the run: the plots (PNG files + Prefect image artifacts); off by default, because drawing
    # them costs about half a second per run (matplotlib): `clgrpo report RUN` draws them whenever asked
    plots: Annotated[bool, NOT_FINGERPRINTED] = False
    seed: int = 0
    initial_library: str | None = None  # a library file to start from (reference, seed or text format)
    # how rollouts are made: its settings that shape results fingerprinted at the top, as before it had a section
    rollout: Annotated[RolloutPlacement, Inlined()] = Field(default_factory=RolloutPlacement)
    validation: ValidationConfig | None = None  # held-out learning curve during training
    # failed items a stage may leave
    tolerance: Annotated[ToleranceConfig, NOT_FINGERPRINTED] = Field(default_factory=ToleranceConfig)
    budget: Annotated[BudgetConfig, NOT_FINGERPRINTED] = Field(default_factory=BudgetConfig)  # tokens / USD to spend
    library: LibraryConfig = Field(default_factory=LibraryConfig)  # near-duplicate control and embeddings
    judge: JudgeConfig | None = None  # grade answers with an LLM judge instead of the domain's verifier
    # a numeric LoRA step on the same trajectories; its settings count only when it is enabled
    hybrid: Annotated[HybridConfig, CountsWhen(lambda run: run.hybrid.enabled)] = Field(default_factory=HybridConfig)
    # the chosen domain's own settings, kept as given and read by the model it declares where the domain is
    # resolved (``schemas.domain_settings``; the web domain: its search and open tools, docs/web.md); {}: its defaults
    domain_settings: Annotated[dict[str, Any], FingerprintedBy(_domain_settings_into)] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _web_settings_moved(cls, data: Any) -> Any:
        """``rollout.agent.web``, where the web domain's settings were before domains owned theirs, still works."""
        if not isinstance(data, dict) or not isinstance(rollout := data.get("rollout"), dict):
            return data
        agent = rollout.get("agent")
        if not isinstance(agent, dict) or "web" not in agent:
            return data
        if data.get("domain_settings"):
            raise ValueError(
                "rollout.agent.web and domain_settings are both set: the web tools' settings go in domain_settings"
            )
        rest = {key: value for key, value in agent.items() if key != "web"}
        return {**data, "rollout": {**rollout, "agent": rest}, "domain_settings": agent["web"]}

    @model_validator(mode="before")
    @classmethod
    def _agents_learn_lessons(cls, data: Any) -> Any:
        """Agent rollouts learn lessons only unless the config sets ``learning.examples``: a worked example is
        shown as its problem and a final reply, and an agent's final reply leaves out the tool calls and results
        that found its answer (a rationalization is written without tools at all), so shown to the agent it
        teaches answering without the tools (the scripted web and python-agent flows stopped calling them and
        fell to accuracy 0 at step 2). Set explicitly, it is kept, and the run warns (``flows.train``)."""
        if not isinstance(data, dict) or _mode_of(data.get("rollout")) != "agent":
            return data
        learning = data.get("learning")
        if learning is None:
            return {**data, "learning": {"examples": "off"}}
        if isinstance(learning, dict) and "examples" not in learning:
            return {**data, "learning": {**learning, "examples": "off"}}
        if isinstance(learning, LearningConfig) and "examples" not in learning.model_fields_set:
            return {**data, "learning": learning.model_copy(update={"examples": "off"})}
        return data

    @property
    def learner_model(self) -> ModelConfig:
        return self.learner or self.policy

    def require_run_id(self) -> str:
        """The run id, which the run sets when it starts (a config file may leave it out)."""
        if self.run_id is None:
            raise ValueError("the config has no run_id yet: the run sets one when it starts")
        return self.run_id

    def fingerprint(self) -> str:
        """Hash of everything that shapes the results (``schemas.config_migrations``: what each field says of
        itself, and the settings added since a run was made left out at the value it had); a run id is bound to
        one fingerprint."""
        return text_hash(json.dumps(fingerprint_payload(self), sort_keys=True))

    @classmethod
    def from_stored(cls, config_json: str) -> RunConfig:
        """A config a run stored, read as it ran: the settings added since, at the value it had
        (``schemas.config_migrations.migrate``)."""
        return cls.model_validate(migrate(json.loads(config_json), cls))
