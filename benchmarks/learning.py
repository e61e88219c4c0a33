"""Learning quality: does a real small model answer held-out problems better with the library it learned?

For each task family (seeded generators, ``domains/math/synthetic.py``) and training seed, ``clgrpo train``
learns a library on a small training set with a real model behind a real OpenAI-compatible server
(llama.cpp's ``llama-server``, started and stopped here), then one ``clgrpo eval`` per family samples a
held-out set (disjoint from every training set; the leakage guard refuses any overlap) under three kinds of
condition with the same prompt apart from the library: no library; each seed's learned library; each seed's
*placebo*, a library of the same number of lessons of about the same length, learned on another task (drawn
from the released reference library, ``data/reference_library_math.json``, learned on competition math: a
longer prompt or any advice must not pass for learning), and two more, baselines a user would try instead of
learning (issue 57): the *oracle lesson*, one correct rule per family written by hand here (never in the product),
evaluated once per family; and *k-shot*, per training seed ``--kshot`` solved training problems drawn at random
(seeded) from that run's own rollouts graded correct, the pool the learner may use, shown as worked examples.
Reported per family: Mean@k of every condition with 95% bootstrap CIs, learned-minus-none, learned-minus-placebo
and learned-minus-k-shot with 95% paired-bootstrap CIs per seed and pooled over seeds, oracle-minus-none, the
baseline's parse rate, the items each run kept by kind (lessons, examples), the tokens and wall time each
training run cost (and tokens per point of gain), and every final lesson. Everything goes through the CLI as
a user runs it; results land in ``--out`` (DuckDB, configs, datasets, results.json) and, with ``--report``, in
benchmarks/learning_runs/REPORT.md (every figure), a summary in benchmarks/REPORT.md, and benchmarks/plots/.

Learners: ``same`` (the policy learns for itself: Qwen2.5-Coder-0.5B) and ``qwen2.5-coder-1.5b`` (a stronger
learner for the same 0.5B policy, served by a second llama-server; a real configuration, e.g. an API learner
for a local model, but not the same claim). Each finished (family, learner, seed) and each family's no-library
measurement is kept as a small JSON file in the repository (``--runs-dir``, default benchmarks/learning_runs/,
one folder per combination of the settings that shape results): a later invocation, on another machine too,
reads those back and runs only what is missing. Within one ``--out``, completed training runs and evaluations
are read back from its DuckDB file; ``results.json`` there keeps every (family, learner) measured, so separate
invocations (another family, another learner) add up to one report. The estimated time is printed first.

    python benchmarks/learning.py --report                       # the full benchmark (hours on 2 cores)
    python benchmarks/learning.py --families ranges --seeds 0 --heldout 12 --k 2    # a small smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the project, and sibling benchmark modules when imported

from report_block import write_block  # noqa: E402

from application.demo import NEAR_DUPLICATE_SIMILARITY  # noqa: E402
from application.llama_server import LlamaServer, ensure_engine  # noqa: E402
from clgrpo.experience.library import ExperienceLibrary, LibraryFormatError, item_text, word_count  # noqa: E402
from clgrpo.models.weights import QWEN_05B, QWEN_15B, fetch_model  # noqa: E402
from clgrpo.reports import metrics  # noqa: E402
from clgrpo.storage.store import LLM_CALL_SENT_AT, Store  # noqa: E402
from domains.math.synthetic import generate_family, write_rows  # noqa: E402
from schemas.config import LearningConfig, LessonValidation, LibraryConfig  # noqa: E402
from schemas.records import Problem, Reward, Rollout  # noqa: E402
from schemas.stages import Stage  # noqa: E402

POLICY = QWEN_05B
LEARNERS = {"same": None, QWEN_15B.fetch_key: QWEN_15B}
REPORT_BEGIN, REPORT_END = "<!-- learning:begin -->", "<!-- learning:end -->"
HELDOUT_SEED = 1000


@dataclass
class Settings:
    families: list[str]
    seeds: list[int]
    learners: list[str]
    train: int
    heldout: int
    k: int
    group_size: int
    epochs: int
    candidates: int
    trial_samples: int
    trial_problems: int
    min_gain: float
    eval_temperature: float
    out: Path
    cache_dir: str | None = None
    # issue 42: lesson trials on other problems of the family with a sequential sign test, and the library gate
    trials: str = "on"  # lesson trials (learning.lesson_validation); "off": one candidate per group, the gate alone
    trials_on: str = "sources_first"
    trial_test: str = "mean"
    trial_max_problems: int | None = None
    trial_alpha: float = 0.05
    trial_order: str = LessonValidation().order  # which candidates the checks budget lets try first
    # the library gate: the product's defaults (learning.library_gate) unless a setting is given
    gate: str = "auto"  # auto, on or off (learning.library_gate.enabled)
    gate_share: float | None = None
    gate_samples: int | None = None
    gate_rule: str | None = None
    gate_adopt_alpha: float | None = None
    gate_temperature: float | None = None  # None: the product's (the rollouts' temperature)
    # learning.checks_budget: what a step's trials and gate may spend, times its own tokens (None: no limit)
    checks_budget: float | None = LearningConfig().checks_budget
    runs_dir: Path = field(default_factory=lambda: RUNS_DIR)  # where each (family, learner, seed) result is kept
    # issue 57: the k-shot baseline's solved training problems per seed (0: no k-shot condition); not in a results
    # folder's key (it shapes no learned result): each seed's file says which k its k-shot condition had
    kshot: int = 2
    # issue 57: worked examples (learning.examples, library.examples_shown, library.examples_as: the product's
    # defaults unless given)
    examples: str = LearningConfig().examples
    examples_shown: int = LibraryConfig().examples_shown
    examples_as: str = LibraryConfig().examples_as


@dataclass
class TrainRun:
    family: str
    learner: str
    seed: int
    run_id: str
    seconds: float
    tokens_policy: int = 0
    tokens_learner: int = 0
    tokens_validation: int = 0
    tokens_gate: int = 0
    gate: list[str] = field(default_factory=list)  # the library gate's decision of each step (its reason)
    lessons: list[str] = field(default_factory=list)  # every item's text (a lesson's; an example's problem, solution)
    items: dict[str, int] = field(default_factory=dict)  # the final library's items by kind (items_by_kind)
    kept: int = 0
    rejected_by_validation: int = 0
    rejected_other: int = 0
    heldout_in_training: int = -1  # held-out problems among the problems the run trained on (must be 0)
    lessons_without_learner: int = -1  # applied lessons that no learner call proposed (hand-written: must be 0)


def run_id(family: str, learner: str, seed: int) -> str:
    return f"{family}-{'self' if learner == 'same' else 'l15'}-s{seed}"


# --- data ------------------------------------------------------------------------------------------------
def write_datasets(s: Settings) -> dict[str, dict]:
    """Per family: a training file per seed and one held-out file disjoint from all of them (and their union,
    for the leakage guard)."""
    out = {}
    for family in s.families:
        folder = s.out / "data" / family
        trains = {seed: generate_family(family, s.train, seed, ids=f"{family}-train{seed}") for seed in s.seeds}
        seen = {r["problem"] for rows in trains.values() for r in rows}
        heldout = generate_family(family, s.heldout, HELDOUT_SEED, exclude=seen, ids=f"{family}-heldout")
        out[family] = {
            "train": {seed: str(write_rows(folder / f"train-s{seed}.jsonl", rows)) for seed, rows in trains.items()},
            "all_train": str(write_rows(folder / "train-all.jsonl", [r for rows in trains.values() for r in rows])),
            "heldout": str(write_rows(folder / "heldout.jsonl", heldout)),
        }
    return out


# --- configs ---------------------------------------------------------------------------------------------
def model_section(alias: str, url: str, *, temperature: float, max_tokens: int) -> dict:
    return {
        "model": alias,
        "base_url": url,
        "api_key_env": None,
        "temperature": temperature,
        "max_tokens": max_tokens,
        "timeout_s": 1800,
        "supports_n": False,
        "json_schema": True,
    }


def train_config(s: Settings, dataset: str, seed: int, policy_url: str, learner_url: str, learner_alias: str) -> dict:
    return {
        "db_path": str(s.out / "learning.duckdb"),
        "domain": "math",
        "seed": seed,
        "dataset": {"path": dataset, "seed": seed},
        "policy": model_section(POLICY.fetch_key, policy_url, temperature=0.7, max_tokens=400),
        "learner": model_section(learner_alias, learner_url, temperature=0.8, max_tokens=300),
        "grpo": {"group_size": s.group_size, "epochs": s.epochs, "batch_size": s.train, "rollout_chunk_size": s.train},
        "learning": {
            "extract": "contrast",
            "candidates": s.candidates,
            "summarize": False,
            "consolidation": "passthrough",
            "min_words": 6,
            "max_words": 40,
            "summarize_chunk_size": s.train,
            "lesson_validation": {
                "enabled": s.trials == "on",
                "samples": s.trial_samples,
                "problems": s.trial_problems,
                "min_gain": s.min_gain,
                "trials_on": s.trials_on,
                "test": s.trial_test,
                "max_problems": s.trial_max_problems,
                "alpha": s.trial_alpha,
                "order": s.trial_order,
            },
            "library_gate": gate_section(s),
            "checks_budget": s.checks_budget,
            "examples": s.examples,
        },
        # near-duplicates (measured: 8 rewordings of one rule in one seed's library) merged as in the demo
        "library": {
            "near_duplicates": "merge",
            "near_duplicate_similarity": NEAR_DUPLICATE_SIMILARITY,
            **example_view(s),
        },
        "concurrency": 8,
        "pipeline": False,
    }


def example_view(s: Settings) -> dict:
    """How worked examples are shown (library.examples_shown, examples_as): the same in training and in every
    evaluated condition (learned, k-shot)."""
    return {"examples_shown": s.examples_shown, "examples_as": s.examples_as}


def gate_section(s: Settings) -> dict:
    """learning.library_gate: the product's defaults, with the settings given on the command line."""
    enabled: bool | str = {"on": True, "off": False}.get(s.gate, s.gate)
    given = {
        "share": s.gate_share,
        "samples": s.gate_samples,
        "rule": s.gate_rule,
        "adopt_alpha": s.gate_adopt_alpha,
        "temperature": s.gate_temperature,
    }
    return {"enabled": enabled, **{k: v for k, v in given.items() if v is not None}}


def write_yaml(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def clgrpo(*args: str, log: Path) -> float:
    """Run the clgrpo CLI as a user would; its output goes to ``log``; returns the wall time."""
    started = time.monotonic()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as out:
        out.write(f"\n$ clgrpo {' '.join(args)}\n")
        out.flush()
        proc = subprocess.Popen([str(Path(sys.executable).with_name("clgrpo")), *args], stdout=out, stderr=out)
        try:
            returncode = proc.wait()
        except BaseException:  # the benchmark is stopped (SIGTERM, Ctrl-C): the run stops too, storing its work
            proc.terminate()
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    if returncode != 0:
        raise SystemExit(f"clgrpo {args[0]} failed (exit {returncode}); see {log}")
    return time.monotonic() - started


def stop_on_sigterm() -> None:
    """SIGTERM (``kill``, a queue script stopped) stops the benchmark as Ctrl-C does: the clgrpo run in progress
    is stopped and the servers it started are stopped, instead of left running on their own."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


# --- training --------------------------------------------------------------------------------------------
def train_run(
    s: Settings, family: str, learner: str, seed: int, data: dict, urls: dict[str, tuple[str, str]]
) -> TrainRun:
    """Train (or read back from ``--out``) one seed of ``family`` with one learner."""
    timings_file = s.out / "train-seconds.json"
    timings = json.loads(timings_file.read_text()) if timings_file.is_file() else {}
    learner_url, alias = urls[learner]
    rid = run_id(family, learner, seed)
    if rid not in timings or not _completed(s, rid):
        config = write_yaml(
            s.out / "configs" / f"{rid}.yaml",
            train_config(s, data[family]["train"][seed], seed, urls["policy"][0], learner_url, alias),
        )
        print(f"training {rid} ...", flush=True)
        timings[rid] = clgrpo("train", "--config", str(config), "--run-id", rid, log=s.out / "logs" / f"{rid}.out")
        timings_file.write_text(json.dumps(timings, indent=1))
    return describe_run(s, TrainRun(family, learner, seed, rid, timings[rid]), data[family]["heldout"])


def _completed(s: Settings, rid: str) -> bool:
    if not (s.out / "learning.duckdb").is_file():
        return False
    with Store(str(s.out / "learning.duckdb"), read_only=True) as store:
        status = store.query("SELECT status FROM runs WHERE run_id = ?", [rid])
    return len(status) == 1 and status["status"][0] == "completed"


def _evaluated(s: Settings, eval_id: str) -> bool:
    if not (s.out / "learning.duckdb").is_file():
        return False
    with Store(str(s.out / "learning.duckdb"), read_only=True) as store:
        return store.stage_done(eval_id, 0, Stage.EVALUATE)


def describe_run(s: Settings, run: TrainRun, heldout: str) -> TrainRun:
    """Costs, outcome counts and the provenance checks of one finished training run."""
    with Store(str(s.out / "learning.duckdb"), read_only=True) as store:
        tokens = store.query(
            "SELECT stage, role, sum(tokens_in + tokens_out) AS t FROM llm_calls WHERE run_id = ? GROUP BY stage, role",
            [run.run_id],
        )
        final = store.load_library(run.run_id)
        run.lessons, run.items = [item_text(e) for e in final], items_by_kind(final)
        ops = store.records("operations", run.run_id)
        trained_on = set(store.query("SELECT DISTINCT problem FROM problems WHERE run_id = ?", [run.run_id])["problem"])
        first_library = store.load_library(run.run_id, 0)
        gates = store.query("SELECT step, reason FROM library_gates WHERE run_id = ? ORDER BY step", [run.run_id])
        run.gate = [f"step {step}: {reason}" for step, reason in zip(gates["step"], gates["reason"])]
    held = {json.loads(line)["problem"] for line in Path(heldout).read_text().splitlines() if line.strip()}
    run.heldout_in_training = len(held & trained_on)
    proposed = [r for r in ops if r.status.value == "applied" and r.operation.op.value in ("add", "modify", "merge")]
    run.lessons_without_learner = len(first_library) + sum(not r.operation.source_groups for r in proposed)
    for stage, role, t in zip(tokens["stage"], tokens["role"], tokens["t"]):
        if stage == Stage.VALIDATE_LESSONS:
            run.tokens_validation += int(t)
        elif stage == Stage.LIBRARY_GATE:
            run.tokens_gate += int(t)
        elif role == "learner":
            run.tokens_learner += int(t)
        else:
            run.tokens_policy += int(t)
    run.kept = sum(r.status.value == "applied" and r.operation.op.value in ("add", "modify", "merge") for r in ops)
    run.rejected_by_validation = sum(
        r.status.value == "rejected" and r.reason.startswith("lesson validation") for r in ops
    )
    run.rejected_other = sum(r.status.value == "rejected" for r in ops) - run.rejected_by_validation
    return run


# --- placebos --------------------------------------------------------------------------------------------
PLACEBO_POOL = ROOT / "data" / "reference_library_math.json"  # lessons learned on competition math (AIME-style)


LONG_ITEM = 60  # words: longer than any lesson (learning.max_words 40): a worked example


def placebo(learned: list[str], pool: list[str]) -> list[str]:
    """As many items as ``learned`` from ``pool`` (lessons learned on another task), each the closest in length
    to one of the learned items (no lesson used twice); a long item (a worked example, its problem and solution)
    is matched by pool lessons joined until about as long."""
    left, chosen = list(pool), []
    for lesson in learned:
        if not left:
            break
        target, joined = word_count(lesson), []
        while left and (not joined or target > LONG_ITEM and word_count(" ".join(joined)) < target):
            missing = target - word_count(" ".join(joined))
            best = min(left, key=lambda other: (abs(word_count(other) - missing), other))
            left.remove(best)
            joined.append(best)
        chosen.append(" ".join(joined))
    return chosen


def placebo_files(s: Settings, runs: list[TrainRun]) -> dict[str, Path]:
    """For each run, a library file of its placebo: as many lessons, of about the same lengths, drawn from the
    released reference library (learned by the reference implementation on competition math, not on these
    families). One fixed pool keeps each placebo independent of which other families ran."""
    pool = [e.text for e in ExperienceLibrary.load(PLACEBO_POOL)]
    files = {}
    for run in runs:
        library = ExperienceLibrary.from_mapping({f"E{i}": t for i, t in enumerate(placebo(run.lessons, pool))})
        files[run.run_id] = library.dump(s.out / "placebo" / f"{run.run_id}.json")
    return files


# --- items by kind -----------------------------------------------------------------------------------------
def item_kind(item: object) -> str:
    """A library item's kind: "example" (a worked example) or "lesson". An item without the field (the product
    before issue 57's examples, and every library kept before them) is a lesson."""
    return str(getattr(item, "kind", "lesson"))


def items_by_kind(items: Iterable[object]) -> dict[str, int]:
    """How many of a library's items are lessons and how many worked examples."""
    kinds = [item_kind(item) for item in items]
    return {"lessons": sum(k != "example" for k in kinds), "examples": sum(k == "example" for k in kinds)}


# --- baselines a user would try instead: the oracle lesson and k-shot -----------------------------------------
# One correct rule per family, written by hand for the oracle-lesson baseline (issue 57): what a library could say
# at best in one lesson. Benchmark only: the product never ships a lesson written by hand.
ORACLE_LESSONS: dict[str, str] = {
    "arithmetic": "Do the operation the words ask for: add what is gained or found, subtract what is given away, "
    "and multiply the number of packs or boxes by how many each holds before adding any extra.",
    "ranges": "To count the whole numbers from a first to a last number with both ends included, compute last - "
    "first + 1, not last - first.",
    "percent": "A percent change is the change divided by the original (starting) amount, times 100, never the "
    "change divided by the new amount.",
    "units": "Square units convert by the length factor squared and cubic units by the length factor cubed, so one "
    "square meter is 100 x 100 = 10,000 square centimeters and one cubic meter is 100 x 100 x 100 cubic centimeters.",
    "shares": "When a fraction is given away and then a fraction of the remaining ones, take the second fraction of "
    "what is left after the first, not of the original total.",
    "durations": "For the minutes between two clock times, turn each time into minutes (hours x 60 + minutes) and "
    "subtract, since an hour has 60 minutes, not 100.",
    "boxes": "When everything must fit, divide the total by what one box holds and round up to the next whole "
    "number whenever there is a remainder.",
    "workers": "More workers take less time: workers x days stays the same, so the new time is workers x days "
    "divided by the new number of workers.",
    "handshakes": "When each pair among n people or teams counts once, the number of pairs is n x (n - 1) / 2.",
    "average": "The missing value is the average times how many values there are, minus the sum of the known values.",
    "posts": "Along a line of length L with a post every d meters and one at each end, there are L / d + 1 posts, "
    "one more than the number of gaps.",
    "speeds": "For a round trip over the same distance at a km/h and b km/h, the average speed is the total distance "
    "over the total time, 2ab / (a + b), not (a + b) / 2.",
    "overlaps": "The people who like A or B number A + B - both, since the sum counts those who like both twice; "
    "those who like neither are the group size minus that.",
}


def oracle_file(s: Settings, family: str) -> Path:
    """The oracle lesson of ``family`` as a one-lesson library file (the reference format, ``{"E0": "..."}``)."""
    return ExperienceLibrary.from_mapping({"E0": ORACLE_LESSONS[family]}).dump(s.out / "oracle" / f"{family}.json")


def oracle_label(family: str) -> str:
    """The oracle condition's label: the lesson's hash in it, so a lesson reworded is another evaluation."""
    return "oracle-" + hashlib.sha256(ORACLE_LESSONS[family].encode()).hexdigest()[:8]


@dataclass(frozen=True)
class Solved:
    """A training problem the policy solved in a training run: one of its rollouts graded correct."""

    problem_id: str
    problem: str
    answer: str
    text: str  # the rollout's completion (its final assistant turn, what the verifier graded)
    step: int
    sample_idx: int


def solved_rollouts(store: Store, run_id: str) -> list[Solved]:
    """Every rollout of a training run graded correct (reward 1), with its problem: the run's own rollouts, the
    pool the learner may learn from (the gate's and the trials' samples are not rollouts of the run)."""
    problems = {p.problem_id: p for p in store.records(Problem, run_id)}
    rollouts = store.frame(Rollout, run_id)
    graded = store.frame(Reward, run_id)
    correct = {
        (int(step), pid, int(j))
        for step, pid, j, reward in zip(graded["step"], graded["problem_id"], graded["sample_idx"], graded["reward"])
        if reward is not None and not np.isnan(reward) and reward >= 1.0
    }
    solved = []
    for step, pid, j, text in zip(
        rollouts["step"], rollouts["problem_id"], rollouts["sample_idx"], rollouts["final_text"]
    ):
        key = (int(step), pid, int(j))
        if key in correct and pid in problems and isinstance(text, str) and text.strip():
            problem = problems[pid]
            solved.append(Solved(pid, problem.problem, problem.answer or "", text.strip(), key[0], key[2]))
    return solved


def kshot_draw(solved: Sequence[Solved], k: int, seed: str) -> list[Solved]:
    """``k`` solved problems drawn at random (seeded by ``seed``), one correct rollout of each, also drawn: no
    selection by length or quality. Fewer than ``k`` solved problems: all of them."""
    rng = random.Random(seed)
    by_problem: dict[str, list[Solved]] = {}
    for x in sorted(solved, key=lambda x: (x.problem_id, x.step, x.sample_idx)):
        by_problem.setdefault(x.problem_id, []).append(x)
    chosen = rng.sample(sorted(by_problem), min(k, len(by_problem)))
    return [rng.choice(by_problem[pid]) for pid in chosen]


def example_item(x: Solved, family: str) -> dict:
    """A worked example as a library file holds it (issue 57's seed format): the problem, the policy's solution
    graded correct, its answer and where it came from."""
    return {
        "kind": "example",
        "problem": x.problem,
        "text": x.text,
        "answer": x.answer,
        "author": POLICY.fetch_key,
        "reward": 1.0,
        "task_tag": family,
        "source_groups": [x.problem_id],
    }


def write_examples(path: Path, examples: Sequence[Solved], family: str) -> Path:
    """A library file of worked examples (seed format: ``{"experiences": {"E0": {...}}, "next_id": N}``)."""
    payload = {
        "experiences": {f"E{i}": example_item(x, family) for i, x in enumerate(examples)},
        "next_id": len(examples),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


@dataclass(frozen=True)
class KShot:
    """One seed's k-shot condition: the solved problems drawn, its library file (None with no solved problem:
    the condition is then the no-library one) and its reward matrix."""

    asked: int
    problems: list[str]
    path: Path | None
    matrix: np.ndarray | None = None


def kshot_library(s: Settings, run: TrainRun) -> KShot:
    """The k-shot library of a training run: ``s.kshot`` of its solved problems, drawn with the run's own seed."""
    with Store(str(s.out / "learning.duckdb"), read_only=True) as store:
        solved = solved_rollouts(store, run.run_id)
    drawn = kshot_draw(solved, s.kshot, f"clgrpo-kshot-{run.run_id}")
    if not drawn:
        return KShot(s.kshot, [], None)
    path = write_examples(s.out / "kshot" / f"{run.run_id}.json", drawn, run.family)
    return KShot(s.kshot, [x.problem_id for x in drawn], path)


def examples_readable() -> bool:
    """Whether this checkout's library loader (the one ``clgrpo eval --library`` uses) reads worked examples."""
    sample = Solved("p-0", "What is 1 + 1?", "2", "1 + 1 = 2, so \\boxed{2}", 0, 0)
    with tempfile.TemporaryDirectory() as folder:
        path = write_examples(Path(folder) / "examples.json", [sample], "arithmetic")
        try:
            library = ExperienceLibrary.load(path)
        except LibraryFormatError:  # a plain string was expected
            return False
    return [item_kind(e) for e in library] == ["example"]


# --- evaluation ------------------------------------------------------------------------------------------
def evaluate_family(
    s: Settings, family: str, data: dict, conditions: dict[str, str], policy_url: str
) -> dict[str, str]:
    """One ``clgrpo eval`` per condition (label -> library reference; each its own eval id, so an interrupted
    benchmark keeps the conditions it finished). An id already stored in ``--out`` is read from there (ids name
    the family, condition, problems and k: other settings need another ``--out``); a sample already drawn with the
    same key (an identical library: an empty learned one and no library) is read, not drawn again. Returns
    condition -> eval id."""
    config = write_yaml(
        s.out / "configs" / f"eval-{family}.yaml",
        {
            "db_path": str(s.out / "learning.duckdb"),
            "domain": "math",
            "dataset": {"path": data[family]["heldout"]},
            "policy": model_section(POLICY.fetch_key, policy_url, temperature=0.7, max_tokens=400),
            "library": example_view(s),
            "concurrency": 8,
        },
    )
    eval_ids = {}
    for label, ref in conditions.items():
        eval_id = f"eval-{family}-{label}-n{s.heldout}-k{s.k}"
        eval_ids[label] = eval_id
        if _evaluated(s, eval_id):
            continue  # stored by an earlier invocation
        print(f"evaluating {family} / {label}: {s.heldout} problems x k={s.k} ...", flush=True)
        clgrpo(
            "eval",
            "--config",
            str(config),
            "--dataset",
            data[family]["heldout"],
            "--k",
            str(s.k),
            "--temperature",
            str(s.eval_temperature),
            "--train-dataset",
            data[family]["all_train"],
            "--refuse-on-leakage",
            "--eval-id",
            eval_id,
            "--library",
            ref,
            log=s.out / "logs" / f"{eval_id}.out",
        )
    return eval_ids


def condition_matrices(s: Settings, eval_ids: dict[str, str], problems: list[str]) -> dict[str, np.ndarray]:
    """Condition -> (problems x k) rewards in the order of ``problems`` (paired comparisons), and "__parsed__"
    -> the share of samples with an extracted answer, per condition."""
    with Store(str(s.out / "learning.duckdb"), read_only=True) as store:
        frames = {
            label: store.query(
                "SELECT problem_id, sample_idx, reward, extracted FROM eval_results WHERE run_id = ?", [eval_id]
            )
            for label, eval_id in eval_ids.items()
        }
    index = {p: i for i, p in enumerate(problems)}
    out = {}
    for label, frame in frames.items():
        matrix = np.full((len(problems), s.k), np.nan)
        for p, j, r in zip(frame["problem_id"], frame["sample_idx"], frame["reward"]):
            matrix[index[p], j] = r
        out[label] = matrix
        out[f"__parsed__{label}"] = np.array([frame["extracted"].notna().mean()])
    return out


def heldout_ids(data: dict, family: str) -> list[str]:
    path = Path(data[family]["heldout"])
    return sorted(json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip())


def sampling_minutes(s: Settings, eval_ids: dict[str, str]) -> float:
    """Wall time the evaluations spent sampling: the time some call of an eval id was in flight, summed over
    the eval ids (read from ``llm_calls``, so an evaluation read back by a resumed benchmark keeps its real cost;
    a pause between an interrupted evaluation and its resumption is not sampling and is not counted)."""
    with Store(str(s.out / "learning.duckdb"), read_only=True) as store:
        busy = store.query(_BUSY_SECONDS_SQL, [list(eval_ids.values())])
    return float(busy["s"].sum() or 0.0) / 60


# the union of each eval id's call intervals, from when a call was sent (after waiting its turn) to when it ended: a
# call sent after every earlier call ended opens an island
_BUSY_SECONDS_SQL = f"""
WITH calls AS (
    SELECT run_id, sent AS s, sent + to_seconds(latency_s) AS e
    FROM (SELECT *, {LLM_CALL_SENT_AT} AS sent FROM llm_calls)
    WHERE list_contains(?, run_id)
), reached AS (
    SELECT *, max(e) OVER (PARTITION BY run_id ORDER BY s, e ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS r
    FROM calls
), islands AS (
    SELECT *, sum(CASE WHEN r IS NULL OR s > r THEN 1 ELSE 0 END)
        OVER (PARTITION BY run_id ORDER BY s, e ROWS UNBOUNDED PRECEDING) AS island
    FROM reached
)
SELECT run_id, island, epoch(max(e) - min(s)) AS s FROM islands GROUP BY run_id, island
"""


def ci(values: np.ndarray, seed: int = 0) -> dict:
    interval = metrics.bootstrap_ci(values, "mean_at_k", n_boot=4000, seed=seed)
    return {"value": interval.value, "low": interval.low, "high": interval.high}


def paired(baseline: np.ndarray, candidate: np.ndarray, seed: int = 0) -> dict:
    interval = metrics.paired_difference(baseline, candidate, "mean_at_k", n_boot=4000, seed=seed)
    return {"value": interval.value, "low": interval.low, "high": interval.high}


def seed_entry(
    run: TrainRun,
    none: np.ndarray,
    learned: np.ndarray,
    fake: np.ndarray,
    placebo_lessons: list[str],
    minutes: float,
    kshot: KShot | None = None,
) -> dict:
    """One (family, learner, seed): its figures against no library, its placebo and its k-shot library (when
    measured), its items by kind, lessons, costs and gate decisions, and its reward matrices (so later invocations
    pool it without its database)."""
    entry: dict[str, Any] = {
        "seed": run.seed,
        "run_id": run.run_id,
        "learned": ci(learned),
        "placebo": ci(fake),
        "learned_minus_none": paired(none, learned),
        "learned_minus_placebo": paired(fake, learned),
        "lessons": run.lessons,
        "placebo_lessons": placebo_lessons,
        "train_seconds": run.seconds,
        "eval_minutes": minutes,
        "tokens": run.tokens_policy + run.tokens_learner + run.tokens_validation + run.tokens_gate,
        "tokens_by_part": {
            "rollouts": run.tokens_policy,
            "learner": run.tokens_learner,
            "validation": run.tokens_validation,
            "gate": run.tokens_gate,
        },
        # the run's tokens against the same steps without lesson trials and the gate
        "checks_cost": _ratio(run),
        "gate": run.gate,
        "kept": run.kept,
        "rejected_by_validation": run.rejected_by_validation,
        "rejected_other": run.rejected_other,
        "heldout_in_training": run.heldout_in_training,
        "lessons_without_learner": run.lessons_without_learner,
        "items_kept": run.items or items_by_kind([None] * len(run.lessons)),
        "matrices": {"learned": _matrix(learned), "placebo": _matrix(fake)},
    }
    if kshot is not None:
        # with no solved problem to show, the k-shot condition is the no-library one: its matrix, not another draw
        matrix = none if kshot.matrix is None else kshot.matrix
        entry |= {
            "kshot": ci(matrix),
            "learned_minus_kshot": paired(matrix, learned),
            "kshot_asked": kshot.asked,
            "kshot_problems": kshot.problems,  # fewer than asked: the run solved fewer training problems
            "kshot_is_none": not kshot.problems,
        }
        entry["matrices"]["kshot"] = _matrix(matrix)
    return entry


def _matrix(m: np.ndarray) -> list[list[float | None]]:
    return [[None if np.isnan(x) else float(x) for x in row] for row in m]


def empty_is_none(entry: dict, base: np.ndarray) -> dict:
    """A run that ended with no lesson answers with the empty library, which is the no-library condition itself
    (its placebo is empty too): one measurement, the none matrix, not the same prompt drawn again (two draws of
    one prompt differ by noise; a result kept before this rule holds such a redraw)."""
    if entry["lessons"]:
        return entry
    same = paired(base, base)
    kshot = entry["matrices"].get("kshot")
    return {
        **entry,
        "learned": ci(base),
        "placebo": ci(base),
        "learned_minus_none": same,
        "learned_minus_placebo": same,
        **({"learned_minus_kshot": paired(_array(kshot), base)} if kshot is not None else {}),
        # a redraw of the empty library is not counted; a k-shot library drawn for the run is
        "eval_minutes": 0.0 if entry.get("kshot_is_none", True) else entry["eval_minutes"],
        "matrices": {**entry["matrices"], "learned": _matrix(base), "placebo": _matrix(base)},
    }


def _array(rows: list[list[float | None]]) -> np.ndarray:
    return np.array([[np.nan if x is None else x for x in row] for row in rows], dtype=float)


def measured_dates(parts: Sequence[dict]) -> str:
    """When a pooled result's parts were measured (kept files say; a part measured now has no date yet): one
    date, or the first and the last."""
    today = time.strftime("%Y-%m-%d")
    dates = sorted({part.get("measured", today) for part in parts})
    return dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"


def pool_family(
    s: Settings,
    family: str,
    learner: str,
    none: dict,
    entries: list[dict],
    command: str,
    oracle: dict | None = None,
) -> dict:
    """The family's result for one learner from its seeds' entries: pooled differences stack the seeds' samples
    per problem; tokens per point of pooled gain only where there is a gain (a run that learned nothing has
    none). learned - k-shot pools only when every seed measured k-shot with this ``--kshot`` (results kept
    before issue 57 did not: None, shown as "-"); oracle - none comes from the family's oracle measurement
    (``oracle``; None where there is none)."""
    base = _array(none["matrix"])
    entries = [empty_is_none(e, base) for e in entries]
    learned_all = [_array(e["matrices"]["learned"]) for e in entries]
    placebo_all = [_array(e["matrices"]["placebo"]) for e in entries]
    n = len(entries)
    pooled_gain = paired(np.tile(base, (1, n)), np.hstack(learned_all))
    tokens = sum(e["tokens"] for e in entries)
    points = 100 * pooled_gain["value"]
    measured_kshot = all("kshot" in e["matrices"] and e.get("kshot_asked") == s.kshot for e in entries)
    kshot_all = [_array(e["matrices"]["kshot"]) for e in entries] if measured_kshot and s.kshot else []
    oracle_rows = _array(oracle["matrix"]) if oracle is not None else None
    return {
        "family": family,
        "learner": learner,
        "command": command,
        "measured": measured_dates([none, *entries]),
        "settings": {
            k: v for k, v in asdict(s).items() if k not in ("out", "cache_dir", "families", "learners", "runs_dir")
        },
        "problems": int(base.shape[0]),
        "k": s.k,
        "none": ci(base),
        "baseline_parsed": none["parsed"],
        "seeds": [{k: v for k, v in e.items() if k != "matrices"} for e in entries],
        "pooled": {
            "learned": ci(np.hstack(learned_all)),
            "placebo": ci(np.hstack(placebo_all)),
            "learned_minus_none": pooled_gain,
            "learned_minus_placebo": paired(np.hstack(placebo_all), np.hstack(learned_all)),
            "kshot": ci(np.hstack(kshot_all)) if kshot_all else None,
            "learned_minus_kshot": paired(np.hstack(kshot_all), np.hstack(learned_all)) if kshot_all else None,
        },
        "oracle": ci(oracle_rows) if oracle_rows is not None else None,
        "oracle_minus_none": paired(base, oracle_rows) if oracle_rows is not None else None,
        "oracle_lesson": oracle["lesson"] if oracle is not None else None,
        "tokens_per_point": tokens / points if points > 0 else None,
        "eval_minutes": none["eval_minutes"]
        + (oracle["eval_minutes"] if oracle is not None else 0.0)
        + sum(e["eval_minutes"] for e in entries),
        "train_seconds": sum(e["train_seconds"] for e in entries),
    }


# --- results kept in the repository, one file per (family, learner, seed) ---------------------------------------
RUNS_DIR: Path = ROOT / "benchmarks" / "learning_runs"
RESULT_SETTINGS = (
    "train",
    "heldout",
    "k",
    "group_size",
    "epochs",
    "candidates",
    "trial_samples",
    "trial_problems",
    "min_gain",
    "eval_temperature",
    "trials",
    "trials_on",
    "trial_test",
    "trial_max_problems",
    "trial_alpha",
    "gate",
    "gate_share",
    "gate_samples",
    "gate_rule",
    "gate_adopt_alpha",
    "gate_temperature",
    "checks_budget",
    "trial_order",
    "examples",
    "examples_shown",
    "examples_as",
)
# settings added after results were kept: left out of a folder's key at this value, so those results stay found
LATER_RESULT_SETTINGS = {
    "gate_temperature": None,
    "checks_budget": None,
    "trial_order": "plan",
    "examples": "off",
    "examples_shown": 2,
    "examples_as": "turns",
}


def results_dir(s: Settings) -> Path:
    """Where this configuration's results are kept: one folder per combination of the settings that shape them,
    so a rerun with the same settings continues and another configuration starts its own."""
    shaping = {k: getattr(s, k) for k in RESULT_SETTINGS}
    shaping = {k: v for k, v in shaping.items() if k not in LATER_RESULT_SETTINGS or v != LATER_RESULT_SETTINGS[k]}
    key = json.dumps(shaping, sort_keys=True)
    return s.runs_dir / hashlib.sha256(key.encode()).hexdigest()[:12]


def load_kept(s: Settings, name: str) -> dict | None:
    path = results_dir(s) / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def keep(s: Settings, name: str, data: dict) -> Path:
    """Write one result file (and the settings it was measured with, once per folder)."""
    folder = results_dir(s)
    folder.mkdir(parents=True, exist_ok=True)
    settings = folder / "settings.json"
    if not settings.is_file():
        settings.write_text(json.dumps({k: getattr(s, k) for k in RESULT_SETTINGS}, indent=1) + "\n")
    path = folder / f"{name}.json"
    path.write_text(
        json.dumps({**data, "measured": time.strftime("%Y-%m-%d"), "commit": code_commit()}, indent=1) + "\n"
    )
    return path


def code_commit() -> str:
    """The commit of the code that measured a result (the settings' hash does not see a change of code)."""
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    return done.stdout.strip() or "unknown"


def _ratio(run: TrainRun) -> float:
    without = run.tokens_policy + run.tokens_learner
    return (without + run.tokens_validation + run.tokens_gate) / without if without else float("nan")


def family_none(s: Settings, family: str, data: dict, policy_url: str) -> dict:
    """The held-out problems with no library: kept in the repository once measured."""
    if (kept := load_kept(s, f"{family}-none")) is not None:
        return kept
    problems = heldout_ids(data, family)
    eval_ids = evaluate_family(s, family, data, {"none": "none"}, policy_url)
    m = condition_matrices(s, eval_ids, problems)
    none = {
        "family": family,
        "problems": problems,
        "matrix": _matrix(m["none"]),
        "parsed": float(m["__parsed__none"][0]),
        "eval_minutes": sampling_minutes(s, eval_ids),
    }
    keep(s, f"{family}-none", none)
    return none


def family_oracle(s: Settings, family: str, data: dict, policy_url: str, none: dict) -> dict:
    """The held-out problems with the family's oracle lesson as the whole library: measured once per family (as
    "none" is), kept in the repository, and measured again only if the lesson is reworded."""
    if (kept := load_kept(s, f"{family}-oracle")) is not None and kept["lesson"] == ORACLE_LESSONS[family]:
        return kept
    label = oracle_label(family)
    eval_ids = evaluate_family(s, family, data, {label: str(oracle_file(s, family))}, policy_url)
    m = condition_matrices(s, eval_ids, none["problems"])
    oracle = {
        "family": family,
        "lesson": ORACLE_LESSONS[family],
        "problems": none["problems"],
        "matrix": _matrix(m[label]),
        "parsed": float(m[f"__parsed__{label}"][0]),
        "eval_minutes": sampling_minutes(s, eval_ids),
    }
    keep(s, f"{family}-oracle", oracle)
    return oracle


def family_seed(
    s: Settings, family: str, learner: str, seed: int, data: dict, urls: dict[str, tuple[str, str]], none: dict
) -> dict:
    """One (family, learner, seed): read from the repository when it was measured with these settings, else
    trained, its placebo and its k-shot library drawn, all evaluated, and kept (an interruption loses at most the
    run in progress)."""
    rid = run_id(family, learner, seed)
    if (kept := load_kept(s, rid)) is not None:
        print(f"{rid}: measured on {kept['measured']}, read from {results_dir(s) / rid}.json", flush=True)
        return kept
    run = train_run(s, family, learner, seed, data, urls)
    base = _array(none["matrix"])
    conditions: dict[str, str] = {}
    fake = placebo_files(s, [run])[rid] if run.lessons else None  # the empty library is the none condition
    if fake is not None:
        conditions |= {rid: f"{rid}:latest", f"placebo-{rid}": str(fake)}
    kshot = kshot_library(s, run) if s.kshot else None
    if kshot is not None and kshot.path is None:
        print(f"{rid}: no training problem solved: its k-shot condition is the no-library one", flush=True)
    elif kshot is not None and len(kshot.problems) < s.kshot:
        print(f"{rid}: {len(kshot.problems)} solved training problems, fewer than k={s.kshot}: all shown", flush=True)
    if kshot is not None and kshot.path is not None:
        conditions[f"kshot{s.kshot}-{rid}"] = str(kshot.path)
    eval_ids = evaluate_family(s, family, data, conditions, urls["policy"][0]) if conditions else {}
    m = condition_matrices(s, eval_ids, none["problems"]) if eval_ids else {}
    if kshot is not None and kshot.path is not None:
        kshot = replace(kshot, matrix=m[f"kshot{s.kshot}-{rid}"])
    learned, placebo_rows = (m[rid], m[f"placebo-{rid}"]) if fake is not None else (base, base)
    minutes = sampling_minutes(s, eval_ids) if eval_ids else 0.0
    placebo_lessons = _lessons(fake) if fake is not None else []
    entry = seed_entry(run, base, learned, placebo_rows, placebo_lessons, minutes, kshot)
    keep(s, rid, {"family": family, "learner": learner, **entry})
    return entry


def _lessons(path: Path) -> list[str]:
    return [e.text for e in ExperienceLibrary.load(path)]


# --- report ----------------------------------------------------------------------------------------------
def fmt(x: dict | None, signed: bool = False) -> str:
    """A figure with its CI; "-" where it was not measured (results kept before the condition existed)."""
    if x is None:
        return "-"
    sign = "+" if signed else ""
    return f"{x['value']:{sign}.3f} [{x['low']:{sign}.3f}, {x['high']:{sign}.3f}]"


def kept_by_kind(x: dict) -> str:
    """A seed's final library as "lessons+examples" ("-" for a result kept before items had kinds)."""
    items = x.get("items_kept")
    return f"{items['lessons']}+{items['examples']}" if items else "-"


def kshot_shown(x: dict) -> str:
    """How many solved problems a seed's k-shot library showed, of k ("-" where k-shot was not measured)."""
    if "kshot_asked" not in x:
        return "-"
    shown = f"{len(x['kshot_problems'])} of {x['kshot_asked']}"
    return shown + " (= none)" if x["kshot_is_none"] else shown


def conditions_sampled(r: dict) -> int:
    """The conditions a result's evaluation minutes cover: none, the oracle lesson, and per seed learned,
    placebo and k-shot (where measured)."""
    return 1 + (r.get("oracle") is not None) + sum(2 + ("kshot_asked" in x) for x in r["seeds"])


# pre-registered (issue 57; issue 42's were arithmetic and workers): never run before the final report
HELD_BACK = ("overlaps", "posts")
NO_HARM_FLOOR = -0.02  # the pooled learned - none point estimate a family may not fall below


def verdict(r: dict) -> str:
    """What a family's pooled result says: gain (learned - none's CI above 0, learned - placebo above 0, and more
    than one seed contributing, i.e. learned - none above 0 in at least two seeds: issue 57's pre-registration;
    a pooled gain carried by one seed says so), harm (the point estimate below NO_HARM_FLOOR or the CI's upper
    bound not above 0), no lesson kept (no harm), or no harm without a clear gain."""
    gain, over_placebo = r["pooled"]["learned_minus_none"], r["pooled"]["learned_minus_placebo"]
    if not any(x["lessons"] for x in r["seeds"]):
        return "no lesson kept (no harm)"
    if gain["low"] > 0 and over_placebo["value"] > 0:
        contributing = sum(x["learned_minus_none"]["value"] > 0 for x in r["seeds"])
        return "gain" if contributing > 1 or len(r["seeds"]) == 1 else "gain carried by one seed"
    if gain["value"] < NO_HARM_FLOOR or gain["high"] <= 0:
        return "HARM"
    return "no harm, no clear gain"


def adopted_steps(x: dict) -> str:
    """A seed's gate decisions as "adopted / steps" (or "off" when no gate ran)."""
    if not x.get("gate"):
        return "off"
    return f"{sum(': adopted,' in d for d in x['gate'])}/{len(x['gate'])}"


def family_label(family: str) -> str:
    return f"{family} (held back)" if family in HELD_BACK else family


def glance(results: list[dict]) -> str:
    """The report's opening table: a row per (family, learner), the pooled differences with their CIs, the
    lessons each seed kept, what the gate adopted, the tokens and the verdict."""
    lines = [
        "| family | learner | learned - none (pooled, 95% CI) | learned - placebo | learned - k-shot "
        "| oracle - none | items kept per seed | lessons+examples per seed | gate adopted per seed | tokens, all seeds "
        "| tokens per point | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p, seeds = r["pooled"], r["seeds"]
        per_point = f"{r['tokens_per_point']:,.0f}" if r["tokens_per_point"] else "no gain"
        lines.append(
            f"| {family_label(r['family'])} | {r['learner']} | {fmt(p['learned_minus_none'], True)} "
            f"| {fmt(p['learned_minus_placebo'], True)} | {fmt(p.get('learned_minus_kshot'), True)} "
            f"| {fmt(r.get('oracle_minus_none'), True)} | {' / '.join(str(len(x['lessons'])) for x in seeds)} "
            f"| {' / '.join(kept_by_kind(x) for x in seeds)} | {' / '.join(adopted_steps(x) for x in seeds)} "
            f"| {sum(x['tokens'] for x in seeds):,} | {per_point} | {verdict(r)} |"
        )
    return "\n".join(lines)


def lessons_caption(r: dict, width: int = 60) -> str:
    """A row's lessons in the picture: how many each seed kept (by kind, lessons+examples, where the result has
    kinds), and the shortest of them (cut to ``width`` characters, between words) as a sample of what was
    learned."""
    kinds = all(x.get("items_kept") for x in r["seeds"])
    name = "lessons+examples" if kinds else "lessons"
    counts = "/".join(kept_by_kind(x) if kinds else str(len(x["lessons"])) for x in r["seeds"])
    kept = [lesson for x in r["seeds"] for lesson in x["lessons"]]
    if not kept:
        return f"{name} {counts}: none kept"
    sample = textwrap.shorten(min(kept, key=len), width, placeholder=" \u2026")  # cut between words
    return f"{name} {counts}: \u201c{sample}\u201d"


def glance_plot(results: list[dict], path: Path) -> None:
    """One picture: a row per (family, learner), learned - none, learned - placebo, learned - k-shot and oracle
    lesson - none with their 95% CIs (the last two where measured), and the lessons kept."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 0.6 * len(results) + 1.2))
    rows = list(reversed(results))
    labelled: set[str] = set()
    for y, r in enumerate(rows):
        for offset, d, color, label in (
            (0.24, r["pooled"]["learned_minus_none"], "#3a7bd5", "learned - none"),
            (0.08, r["pooled"]["learned_minus_placebo"], "#d9a441", "learned - placebo"),
            (-0.08, r["pooled"].get("learned_minus_kshot"), "#5a9e4b", "learned - k-shot"),
            (-0.24, r.get("oracle_minus_none"), "#8e6bbf", "oracle lesson - none"),
        ):
            if d is None:  # a result kept before the condition existed
                continue
            ax.errorbar(
                d["value"],
                y + offset,
                xerr=[[d["value"] - d["low"]], [d["high"] - d["value"]]],
                fmt="o",
                color=color,
                capsize=3,
                markersize=4,
                label=None if label in labelled else label,
            )
            labelled.add(label)
        ax.annotate(lessons_caption(r), (1.01, y), xycoords=("axes fraction", "data"), fontsize=7, va="center")
    ax.axvline(0, color="#444444", linewidth=0.8)
    ax.set_yticks(range(len(rows)), [f"{family_label(r['family'])} / {r['learner']}" for r in rows], fontsize=8)
    ax.set_xlabel("held-out Mean@k difference, pooled over seeds (95% paired-bootstrap CI)", fontsize=8)
    ax.legend(fontsize=7, loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # widened to the labels and the captions beside the axes


def markdown(results: list[dict]) -> str:
    """The report section for every (family, learner) result in ``results`` (one or several invocations)."""
    first = results[0]["settings"]
    lines = [
        f"Measured on this project's 2-core machine (no GPU): policy {POLICY.name} (llama-server, 8 slots), "
        f"G={first['group_size']}, {first['epochs']} epoch(s), {first['candidates']} contrast candidates per group, "
        + (
            f"lesson validation on {first['trial_problems']} problems x {first['trial_samples']} samples (min gain "
            f"{first['min_gain']:g})"
            if first.get("trials", "on") == "on"
            else "no lesson trials (the library gate alone)"
        )
        + f"; held-out problems sampled at temperature {first['eval_temperature']:g}; placebo "
        f"lessons length-matched from {PLACEBO_POOL.relative_to(ROOT)}; the oracle lesson: one correct rule per "
        "family written by hand in the benchmark (never in the product), the whole library, measured once per "
        f"family; k-shot: per seed k={first.get('kshot', 2)} solved training problems drawn at random (seeded) "
        'from the run\'s own rollouts graded correct, shown as worked examples ("-": a result kept before these '
        "baselines existed). Mean@k with 95% bootstrap CIs; differences with 95% paired-bootstrap CIs over "
        "held-out problems, pooled over the seeds.",
        "",
        "| family | learner | seeds | train / held-out x k | none | oracle lesson | placebo (pooled) "
        "| k-shot (pooled) | learned (pooled) | learned - none | learned - placebo | learned - k-shot "
        "| oracle - none | baseline parsed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p, cfg = r["pooled"], r["settings"]
        lines.append(
            f"| {r['family']} | {r['learner']} | {', '.join(map(str, cfg['seeds']))} "
            f"| {cfg['train']} / {r['problems']} x {r['k']} | {fmt(r['none'])} | {fmt(r.get('oracle'))} "
            f"| {fmt(p['placebo'])} | {fmt(p.get('kshot'))} | {fmt(p['learned'])} "
            f"| {fmt(p['learned_minus_none'], True)} | {fmt(p['learned_minus_placebo'], True)} "
            f"| {fmt(p.get('learned_minus_kshot'), True)} | {fmt(r.get('oracle_minus_none'), True)} "
            f"| {r['baseline_parsed']:.0%} |"
        )
    lines += ["", "Commands (each resumes from its `--out` folder) and what the result cost in wall time:", ""]
    lines += [
        f"- {r['family']} / {r['learner']}, measured {r['measured']}: `{r['command']}`; training "
        f"{r['train_seconds'] / 60:.0f} min over {len(r['seeds'])} seeds, evaluation {r['eval_minutes']:.0f} min "
        f'of sampling over {conditions_sampled(r)} conditions (the "none" and oracle-lesson conditions are shared '
        "by every learner of a family)"
        for r in results
    ]
    lines += [
        "",
        "Per seed (Mean@k differences with 95% paired-bootstrap CIs over held-out problems):",
        "",
        "| family | learner | seed | lessons kept / rejected by validation | final lessons+examples "
        "| learned - none | learned - placebo | learned - k-shot | k-shot problems shown | training time "
        "| tokens (rollouts / learner / validation / gate) | with checks / without |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for x in r["seeds"]:
            t = x["tokens_by_part"]
            lines.append(
                f"| {r['family']} | {r['learner']} | {x['seed']} | {x['kept']} / {x['rejected_by_validation']} "
                f"| {kept_by_kind(x)} | {fmt(x['learned_minus_none'], True)} "
                f"| {fmt(x['learned_minus_placebo'], True)} | {fmt(x.get('learned_minus_kshot'), True)} "
                f"| {kshot_shown(x)} | {x['train_seconds'] / 60:.0f} min | {x['tokens']:,} ({t['rollouts']:,} / "
                f"{t['learner']:,} / {t['validation']:,} / {t.get('gate', 0):,}) "
                f"| {x.get('checks_cost', float('nan')):.2f}x |"
            )
    gated = [(r, x) for r in results for x in r["seeds"] if x.get("gate")]
    if gated:
        lines += ["", "The library gate's decisions:", ""]
        lines += [
            f"- {r['family']} / {r['learner']} / seed {x['seed']}: "
            + "; ".join(x["gate"])
            + ("" if x["lessons"] else " (the run ended with no lesson: no harm, and no gain)")
            for r, x in gated
        ]
    checks = [x for r in results for x in r["seeds"]]
    lines += [
        "",
        f"Provenance checks over {len(checks)} training runs: held-out problems among the problems "
        f"trained on: {sum(x['heldout_in_training'] for x in checks)}; applied lessons that no learner call "
        f"proposed (hand-written, or a non-empty starting library): "
        f"{sum(x['lessons_without_learner'] for x in checks)}. The learner's prompts are built from the run's own "
        "rollouts of its training problems; `clgrpo eval --refuse-on-leakage` refused any held-out problem "
        "near-duplicating a training problem (none did).",
    ]
    lines += [
        "",
        "Tokens per point of pooled gain (learned - none, in percentage points): "
        + "; ".join(
            f"{r['family']}/{r['learner']}: {r['tokens_per_point']:,.0f}"
            if r["tokens_per_point"]
            else f"{r['family']}/{r['learner']}: no gain"
            for r in results
        ),
    ]
    oracles = {r["family"]: r["oracle_lesson"] for r in results if r.get("oracle_lesson")}
    if oracles:
        lines += ["", "The oracle lessons (written by hand in the benchmark, one per family):", ""]
        lines += [f'- {family}: "{lesson}"' for family, lesson in oracles.items()]
    lines += [
        "",
        "Every final lesson:",
        "",
    ]
    for r in results:
        for x in r["seeds"]:
            shown = "; ".join(f'"{t}"' for t in x["lessons"]) or "(none kept)"
            lines.append(f"- {r['family']} / {r['learner']} / seed {x['seed']}: {shown}")
    return "\n".join(lines)


BAR_COLORS = {"none": "#888888", "oracle": "#8e6bbf", "placebo": "#d9a441", "k-shot": "#5a9e4b", "learned": "#3a7bd5"}


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.6), squeeze=False)
    for ax, r in zip(axes[0], results):
        bars = [("none", r["none"]), ("oracle lesson", r.get("oracle"))]
        for x in r["seeds"]:
            bars += [(f"placebo s{x['seed']}", x["placebo"]), (f"k-shot s{x['seed']}", x.get("kshot"))]
            bars += [(f"learned s{x['seed']}", x["learned"])]
        bars += [("placebo pooled", r["pooled"]["placebo"]), ("k-shot pooled", r["pooled"].get("kshot"))]
        bars += [("learned pooled", r["pooled"]["learned"])]
        labels = [label for label, v in bars if v is not None]  # k-shot and the oracle where measured
        values = [v for _, v in bars if v is not None]
        means = [v["value"] for v in values]
        errors = [[v["value"] - v["low"] for v in values], [v["high"] - v["value"] for v in values]]
        colors = [BAR_COLORS[next((k for k in BAR_COLORS if label.startswith(k)), "learned")] for label in labels]
        ax.bar(range(len(values)), means, yerr=errors, color=colors, capsize=3)
        ax.set_xticks(range(len(values)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylim(0, 1)
        ax.set_title(f"{r['family']} (learner: {r['learner']})", fontsize=9)
        ax.set_ylabel(f"held-out Mean@{r['k']} (95% CI)", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# the whole section (tables per seed, the gate's decisions, every lesson) goes beside the kept results; REPORT.md
# gets its summary: the picture and a table of the pooled differences within its 120 characters a line
DETAILS = ROOT / "benchmarks" / "learning_runs" / "REPORT.md"
DETAILS_HEADING = "Learning benchmark: every figure"
SUMMARY_BEGIN, SUMMARY_END = "<!-- learning-summary:begin -->", "<!-- learning-summary:end -->"


def ci2(x: dict | None) -> str:
    """A difference with its CI to two decimals ("-" where not measured): the summary's narrow cells."""
    return "-" if x is None else f"{x['value']:+.2f} [{x['low']:+.2f}, {x['high']:+.2f}]"


def learner_label(learner: str) -> str:
    """``same`` as it is, a learner model by its size (qwen2.5-coder-1.5b: 1.5B)."""
    return learner if learner == "same" else learner.rsplit("-", 1)[-1].upper()


def summary(results: list[dict]) -> str:
    """benchmarks/REPORT.md's part of the section: the picture, per (family, learner) the pooled differences
    with their 95% CIs and the verdict (every line within 120 characters), and where every figure is."""
    lines = [
        "![learned - none, learned - placebo, learned - k-shot and oracle lesson - none per family]"
        "(plots/learning-glance.png)",
        "",
        "| family | learner | learned - none | learned - placebo | learned - k-shot | verdict |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        p = r["pooled"]
        family = r["family"] + ("*" if r["family"] in HELD_BACK else "")
        lines.append(
            f"| {family} | {learner_label(r['learner'])} | {ci2(p['learned_minus_none'])} "
            f"| {ci2(p['learned_minus_placebo'])} | {ci2(p.get('learned_minus_kshot'))} | {verdict(r)} |"
        )
    verdicts: dict[str, int] = {}
    for r in results:
        verdicts[verdict(r)] = verdicts.get(verdict(r), 0) + 1
    lines += [
        "",
        "Held-out Mean@k differences pooled over the seeds, 95% paired-bootstrap CIs (`-`: not measured"
        + ("; `*`: held back" if any(r["family"] in HELD_BACK for r in results) else "")
        + "); learner `same`: the 0.5B policy learns for itself, else the learner model's size. Verdicts over the "
        f"{len(results)} rows: "
        + "; ".join(f"{name}: {n}" for name, n in verdicts.items())
        + ". Per seed, the gate's decisions, every lesson, the oracle lessons, the commands and what each cost: "
        "[learning_runs/REPORT.md](learning_runs/REPORT.md).",
    ]
    return "\n".join(lines)


# --- lesson trials against the gate alone, from the kept results ---------------------------------------------
TRIALS_BEGIN, TRIALS_END = "<!-- learning-trials:begin -->", "<!-- learning-trials:end -->"


def kept_family(s: Settings, family: str, learner: str) -> dict | None:
    """A family's pooled result from the files kept for these settings (the seeds measured so far), or None."""
    none = load_kept(s, f"{family}-none")
    entries = [e for seed in s.seeds if (e := load_kept(s, run_id(family, learner, seed))) is not None]
    if none is None or not entries:
        return None
    return pool_family(s, family, learner, none, entries, "", load_kept(s, f"{family}-oracle"))


def trials_comparison(s: Settings) -> str:
    """Per family and learner, the same settings with lesson trials and with the library gate alone (``--trials
    on`` / ``off``): pooled held-out differences, lessons, gate adoptions, tokens, tokens per point and the
    checks' cost per seed, read from the kept results (nothing is run)."""
    lines = [
        "| family | learner | trials | seeds measured | learned - none (pooled) | learned - placebo | lessons kept "
        "| gate adopted | tokens | tokens per point | with checks / without, per seed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for family in s.families:
        for learner in s.learners:
            for trials in ("off", "on"):
                setting = Settings(
                    **{**asdict(s), "trials": trials, "candidates": s.candidates if trials == "on" else 1}
                )
                r = kept_family(setting, family, learner)
                if r is None:
                    continue
                seeds, p = r["seeds"], r["pooled"]
                per_point = f"{r['tokens_per_point']:,.0f}" if r["tokens_per_point"] else "no gain"
                costs = " / ".join(f"{x['checks_cost']:.2f}x" for x in seeds)
                lines.append(
                    f"| {family_label(family)} | {learner} | {trials} | {', '.join(str(x['seed']) for x in seeds)} "
                    f"| {fmt(p['learned_minus_none'], True)} | {fmt(p['learned_minus_placebo'], True)} "
                    f"| {' / '.join(str(len(x['lessons'])) for x in seeds)} "
                    f"| {' / '.join(adopted_steps(x) for x in seeds)} | {sum(x['tokens'] for x in seeds):,} "
                    f"| {per_point} | {costs} |"
                )
    return "\n".join(lines)


# --- main ------------------------------------------------------------------------------------------------
def start_servers(s: Settings) -> tuple[list[LlamaServer], dict[str, tuple[str, str]]]:
    engine = ensure_engine(s.cache_dir)  # built once, smoke-tested on this machine
    policy = LlamaServer(
        fetch_model(POLICY, s.cache_dir).gguf,
        POLICY.fetch_key,
        slots=8,
        cache=s.cache_dir,
        engine=engine,
        log_path=s.out / "logs" / "policy-server.log",
    ).start()
    servers, urls = (
        [policy],
        {"policy": (policy.base_url, POLICY.fetch_key), "same": (policy.base_url, POLICY.fetch_key)},
    )
    for key in s.learners:
        model = LEARNERS[key]
        if model is not None:
            server = LlamaServer(
                fetch_model(model, s.cache_dir).gguf,
                model.fetch_key,
                slots=2,
                cache=s.cache_dir,
                engine=engine,
                context_per_slot=8192,
                log_path=s.out / "logs" / f"{key}-server.log",
            ).start()
            servers.append(server)
            urls[key] = (server.base_url, model.fetch_key)
    return servers, urls


@dataclass(frozen=True)
class Mode:
    report: bool  # write benchmarks/learning_runs/REPORT.md and the summary in benchmarks/REPORT.md
    compare_trials: bool  # run nothing: the kept results with and without lesson trials


def parse(argv: Sequence[str] | None = None) -> tuple[Settings, Mode]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="ranges,percent")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--learners", default="same", help=f"same and/or {QWEN_15B.fetch_key}")
    ap.add_argument("--train", type=int, default=20, help="training problems per seed (<= 50)")
    ap.add_argument("--heldout", type=int, default=24)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--candidates", type=int, default=2)
    ap.add_argument("--trial-samples", type=int, default=3)
    ap.add_argument("--trial-problems", type=int, default=1)
    ap.add_argument("--min-gain", type=float, default=0.1)
    ap.add_argument("--eval-temperature", type=float, default=0.3)
    ap.add_argument(
        "--trials",
        choices=["on", "off"],
        default="on",
        help="lesson trials before the gate; off: one contrast candidate per group and the library gate alone",
    )
    ap.add_argument("--trials-on", choices=["sources_first", "others"], default="sources_first")
    ap.add_argument("--trial-test", choices=["mean", "sign"], default="mean")
    ap.add_argument("--trial-max-problems", type=int, help="sign test: problems at most per candidate")
    ap.add_argument("--trial-alpha", type=float, default=0.05)
    ap.add_argument(
        "--trial-order",
        choices=["plan", "support"],
        default=LessonValidation().order,
        help="learning.lesson_validation.order: which candidates the checks budget lets try first (default: the "
        "product's)",
    )
    ap.add_argument("--gate", choices=["auto", "on", "off"], default="auto", help="learning.library_gate.enabled")
    ap.add_argument("--gate-share", type=float, help="default: the product's (learning.library_gate)")
    ap.add_argument("--gate-samples", type=int, help="default: the product's")
    ap.add_argument("--gate-rule", choices=["better", "significant"], help="default: the product's")
    ap.add_argument("--gate-adopt-alpha", type=float, help="default: the product's")
    ap.add_argument("--gate-temperature", type=float, help="default: the product's (the rollouts')")
    ap.add_argument(
        "--checks-budget",
        type=_budget,
        default=LearningConfig().checks_budget,
        help="learning.checks_budget: a step's trials and gate spend at most this times its own tokens; none: no "
        "limit (default: the product's)",
    )
    ap.add_argument(
        "--kshot",
        type=int,
        default=2,
        help="the k-shot baseline: solved training problems per seed shown as worked examples (0: no k-shot "
        "condition; default 2)",
    )
    ap.add_argument(
        "--examples",
        choices=["off", "rollouts", "rationalize"],
        default=LearningConfig().examples,
        help="learning.examples: worked examples as candidates beside lessons (default: the product's)",
    )
    ap.add_argument("--examples-shown", type=int, default=LibraryConfig().examples_shown, help="library.examples_shown")
    ap.add_argument(
        "--examples-as", choices=["turns", "block"], default=LibraryConfig().examples_as, help="library.examples_as"
    )
    ap.add_argument("--out", default="runs/learning-benchmark")
    ap.add_argument(
        "--runs-dir",
        default=str(RUNS_DIR),
        help="where each (family, learner, seed) result is kept and read back (commit it: a later invocation, "
        "on another machine too, continues from there)",
    )
    ap.add_argument("--cache-dir")
    ap.add_argument(
        "--report",
        action="store_true",
        help="write the results into benchmarks/learning_runs/REPORT.md, their summary into REPORT.md, the plots",
    )
    ap.add_argument(
        "--compare-trials",
        action="store_true",
        help="run nothing: the kept results with lesson trials and with the gate alone side by side (with --report: "
        "into benchmarks/learning_runs/REPORT.md)",
    )
    a = ap.parse_args(argv)
    if a.train > 50:
        ap.error("--train: at most 50 training problems per seed")
    if a.kshot < 0:
        ap.error("--kshot: 0 or more")
    return Settings(
        a.families.split(","),
        [int(x) for x in a.seeds.split(",")],
        a.learners.split(","),
        a.train,
        a.heldout,
        a.k,
        a.group_size,
        a.epochs,
        a.candidates if a.trials == "on" else 1,  # more than one needs trials to choose among them
        a.trial_samples,
        a.trial_problems,
        a.min_gain,
        a.eval_temperature,
        Path(a.out).resolve(),
        a.cache_dir,
        a.trials,
        a.trials_on,
        a.trial_test,
        a.trial_max_problems,
        a.trial_alpha,
        a.trial_order,
        a.gate,
        a.gate_share,
        a.gate_samples,
        a.gate_rule,
        a.gate_adopt_alpha,
        a.gate_temperature,
        a.checks_budget,
        Path(a.runs_dir).resolve(),
        a.kshot,
        a.examples,
        a.examples_shown,
        a.examples_as,
    ), Mode(a.report, a.compare_trials)


def _budget(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def save_results(s: Settings, results: list[dict], minutes: float) -> list[dict]:
    """Merge this invocation's results into ``results.json`` (a (family, learner) measured again replaces the
    earlier one), so later invocations, e.g. another family or learner, extend one report. Returns them all."""
    path = s.out / "results.json"
    earlier = json.loads(path.read_text())["results"] if path.is_file() else []
    for r in results:
        r["command_minutes"] = minutes
    mine = {(r["family"], r["learner"]) for r in results}
    merged = [r for r in earlier if (r["family"], r["learner"]) not in mine and "settings" in r] + results
    path.write_text(json.dumps({"results": merged}, indent=1))
    return merged


# what a run and a sample took here (2026-11-25/27, 2 cores, llama-server): the estimate printed before a start
MINUTES_PER_TRAINING_RUN = {"same": 7.0, QWEN_15B.fetch_key: 12.0}
# issue 57's report (2026-11-28/29, 2 cores; the CPU differs between sessions): one condition of 96 samples took 2 to
# 4 minutes in its first sessions and 4 to 9 on an AMD EPYC (replies of 300-400 tokens at 6-7 tokens/s per slot);
# the 0.4 s before came from sampling minutes that counted only an evaluation's longest call
SECONDS_PER_EVAL_SAMPLE = 3.0


def estimate_minutes(s: Settings) -> tuple[float, str]:
    """The whole invocation's expected time, and how it was reckoned: training runs not yet completed in
    ``--out`` at their measured minutes, and the evaluation samples (no library and the oracle lesson once per
    family; a learned, a placebo and a k-shot library per run)."""
    runs = [
        (learner, run_id(family, learner, seed)) for family in s.families for learner in s.learners for seed in s.seeds
    ]
    todo = [(learner, rid) for learner, rid in runs if not _completed(s, rid) and load_kept(s, rid) is None]
    train = sum(MINUTES_PER_TRAINING_RUN.get(learner, 12.0) * s.train / 20 for learner, _ in todo)
    nones = sum(load_kept(s, f"{family}-none") is None for family in s.families)
    oracles = sum(not _oracle_kept(s, family) for family in s.families)
    per_run = 3 if s.kshot else 2
    samples = (nones + oracles) * s.heldout * s.k + per_run * len(todo) * s.heldout * s.k
    evaluation = samples * SECONDS_PER_EVAL_SAMPLE / 60
    how = (
        f"{len(todo)} of {len(runs)} training runs to do at ~{train / max(1, len(todo)):.0f} min each, "
        f"{samples:,} evaluation samples at ~{SECONDS_PER_EVAL_SAMPLE:g} s ({nones} no-library and {oracles} "
        f"oracle-lesson conditions, {per_run} conditions per run: learned, placebo{', k-shot' if s.kshot else ''})"
    )
    return train + evaluation, how


def _oracle_kept(s: Settings, family: str) -> bool:
    kept = load_kept(s, f"{family}-oracle")
    return kept is not None and kept["lesson"] == ORACLE_LESSONS.get(family)


def main(argv: Sequence[str] | None = None) -> int:
    s, mode = parse(argv)
    report = mode.report
    if mode.compare_trials:  # read back, run nothing
        table = trials_comparison(s)
        print(table)
        if report:
            block = f"{TRIALS_BEGIN}\n{table}\n{TRIALS_END}"
            write_block(block, TRIALS_BEGIN, TRIALS_END, "What the learning checks cost", DETAILS)
        return 0
    if s.kshot and not examples_readable():
        raise SystemExit(
            "the k-shot baseline shows worked examples, which this checkout's library files cannot hold yet "
            "(issue 57); --kshot 0 runs without it"
        )
    started = time.monotonic()
    stop_on_sigterm()
    minutes, how = estimate_minutes(s)
    print(f"estimated time: {minutes / 60:.1f} h ({how}; measured on 2 cores, CPU only)", flush=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    command = "python benchmarks/learning.py " + " ".join(sys.argv[1:] if argv is None else argv)
    data = write_datasets(s)
    servers, urls = start_servers(s)
    try:
        results = []
        for family in s.families:  # "none" is sampled once per family, for every learner and seed
            none = family_none(s, family, data, urls["policy"][0])
            oracle = family_oracle(s, family, data, urls["policy"][0], none)  # once per family too
            for learner in s.learners:
                entries = [family_seed(s, family, learner, seed, data, urls, none) for seed in s.seeds]
                results.append(pool_family(s, family, learner, none, entries, command.strip(), oracle))
            save_results(s, results, (time.monotonic() - started) / 60)  # a family at a time: partial runs count
    finally:
        for server in servers:
            server.stop()
    every = save_results(s, results, (time.monotonic() - started) / 60)
    section = glance(every) + "\n\n" + markdown(every)
    print(section)
    if report:
        glance_plot(every, ROOT / "benchmarks" / "plots" / "learning-glance.png")
        plot(every, ROOT / "benchmarks" / "plots" / "learning.png")
        body = (
            "![learned - none and learned - placebo per family](../plots/learning-glance.png)\n\n"
            + section
            + "\n\n![held-out Mean@k per condition](../plots/learning.png)"
        )
        write_block(f"{REPORT_BEGIN}\n{body}\n{REPORT_END}", REPORT_BEGIN, REPORT_END, DETAILS_HEADING, DETAILS)
        heading = "Learning quality: held-out accuracy with a learned library, none and a placebo"
        write_block(f"{SUMMARY_BEGIN}\n{summary(every)}\n{SUMMARY_END}", SUMMARY_BEGIN, SUMMARY_END, heading)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
