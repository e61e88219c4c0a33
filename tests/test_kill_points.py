"""SIGKILL `clgrpo train` at seeded points, rerun it to completion, and compare it with an uninterrupted run.

Claim: SIGKILL at >= 15 seeded points (a short variant of 3 in the default run) leaves no duplicates, no
operation applied twice, the same structure and counts as an uninterrupted run (the same libraries, even), every
request accounted within the calls in flight at a kill, and no orphan processes.

Setup: one real ``prefect server`` for the module (every CLI process talks to it through PREFECT_API_URL, so
none starts a temporary server), one fake OpenAI server per run in this process, answering as a seeded
``ScriptedWorld`` with a small latency, so a run lasts several seconds and kills land inside stages.

Where the kills land. Each attempt first pays a fixed start-up (imports, preflight, the flow run, the verifier
pool, reading back what is stored) before it reaches unfinished work; a delay drawn uniformly over the
reference run's whole duration would make the first one or two attempts finish the run and leave the other
points killing a rerun that only reads back. So the seeded points are placed by progress, of two kinds:

* ``work`` (three in four): a target drawn uniformly among the reference run's distinct model requests (sorted,
  so the points move through the run's steps and stages): the kill comes ``offset`` seconds (uniform in
  [0, 0.5 s): mid-request, journaling, grading, a stage write) after the world has answered that many distinct
  requests of the killed run to a live client (a redone request is not progress: the seeded world answers it
  identically); when an earlier attempt already got past the target, ``offset`` after the attempt's first
  model request;
* ``setup`` (every fourth): the kill comes ``offset`` seconds after the process started, drawn uniformly between
  1 s and the reference run's time to its first request: imports, preflight, creating the flow run, marking
  stale flow runs crashed, ingesting the journal of the previous kill, reading stored stages back.

An attempt that finishes before its kill is reported (``finished``), not failed. Nothing is asserted about
timing.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import yaml

from clgrpo.storage.journal import run_journal_dir
from clgrpo.storage.store import Store
from clgrpo.testing.fake_openai import ChatRequest, FakeOpenAIServer
from clgrpo.testing.scripted_llm import ScriptedWorld, make_problems, write_jsonl
from tests.processes import PrefectApi, gone

ROOT = Path(__file__).resolve().parents[1]
# starts a real `prefect server` (and, for the full variant, takes minutes)
pytestmark = pytest.mark.integration

WORLD_SEED, DATA_SEED, POLICY_SEED = 2, 5, 7
LATENCY_S = 0.2  # per model request: a run lasts several seconds
CONCURRENCY = 8
ORPHAN_LIMIT_S = 10.0  # a child of a killed CLI must be gone this long after the kill
RUN_LIMIT_S = 600.0  # an attempt that is not killed (the reference, the final rerun): generous, a loaded 2-core box
WORK_OFFSET_S = 0.5  # a work point's kill comes up to this long after its progress target
NO_DUP_KEYS = {  # table -> the key a row must be unique by (within the run)
    "rollouts": ("step", "problem_id", "sample_idx"),
    "rewards": ("step", "problem_id", "sample_idx"),
    "group_advantages": ("step", "problem_id"),
    "summaries": ("step", "problem_id", "sample_idx"),
    "proposals": ("step", "stage", "group_id"),
    "operations": ("step", "seq"),
    "library_versions": ("version",),
    "stage_runs": ("step", "stage"),
    "llm_calls": ("call_id", "retries"),
    "problems": ("step", "position"),
}


# --- a scripted world that answers like a seeded model ---------------------------------------------------
class SeededWorld(ScriptedWorld):
    """``ScriptedWorld`` whose draws for a request that carries a seed depend on (world seed, messages, seed + i)
    only: the same request gets the same reply however often it is sent, as from a seeded model (sample i of a
    request with seed s is drawn as s + i, like the client's one-sample fallback and the local backends).

    Why: ``ScriptedWorld`` draws by how often it has seen the exact prompt (its ``occurrence``), so a request
    that a killed attempt sent and its rerun sends again is that prompt's second occurrence and gets another
    reply; the killed run's rollouts, and hence its library, would differ from the reference's for that reason
    alone. With ``policy.seed`` set every request carries a seed (the learner is the policy model here).

    ``answered``: the distinct requests (messages, seed) answered so far, in order: the kill points' measure of
    progress."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed=seed)
        self.answered: dict[tuple[str, int | None], None] = {}

    def _occurrence(self, request: ChatRequest) -> tuple[str, int]:
        occurrence = super()._occurrence(request)
        with self._lock:
            self.answered.setdefault((occurrence[0], request.seed), None)
        return occurrence

    def progress(self) -> int:
        with self._lock:
            return len(self.answered)

    def forget_after(self, n: int) -> None:
        """Requests first answered after the n-th were answered to a killed client: not progress (its rerun
        sends them again)."""
        with self._lock:
            self.answered = dict.fromkeys(list(self.answered)[:n])

    def _rng(self, request: ChatRequest, occurrence: tuple[str, int], index: int) -> random.Random:
        if request.seed is None:
            return super()._rng(request, occurrence, index)
        key = f"{self.seed}:{occurrence[0]}:seed={request.seed + index}".encode("utf-8")
        return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "big"))


def llm_server() -> FakeOpenAIServer:
    return FakeOpenAIServer(SeededWorld(seed=WORLD_SEED), latency=lambda _request: LATENCY_S)


# --- processes --------------------------------------------------------------------------------------------
def describe(proc: psutil.Process) -> str:
    try:
        return f"pid {proc.pid}: {' '.join(proc.cmdline())[:160]}"
    except psutil.Error:
        return f"pid {proc.pid}"


def cli_env(api: PrefectApi, where: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_API_URL=api.url,
        PREFECT_HOME=str(where / "prefect-home"),
        PREFECT_LOGGING_LEVEL="WARNING",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        CLGRPO_STATE_DIR=str(where / "state"),
        PYTHONUNBUFFERED="1",
    )
    return env


def flow_runs_of(api: PrefectApi, db_path: Path) -> list[dict]:
    """The `train` flow runs (state, name) whose config names ``db_path``."""
    body = json.dumps({"limit": 200}).encode()
    request = urllib.request.Request(
        f"{api.url}/flow_runs/filter", data=body, method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        runs = json.loads(response.read())
    mine = []
    for run in runs:
        config = (run.get("parameters") or {}).get("config") or {}
        if isinstance(config, dict) and config.get("db_path") == str(db_path):
            mine.append(
                {
                    "name": run["name"],
                    "state": (run.get("state") or {}).get("type"),
                    "message": (run.get("state") or {}).get("message"),
                }
            )
    return mine


# --- one attempt of `clgrpo train` ------------------------------------------------------------------------
@dataclass
class Attempt:
    proc: subprocess.Popen
    started: float
    out: Path
    requests_before: int
    children: dict[int, psutil.Process] = field(default_factory=dict)
    first_request_s: float | None = None  # from the process start

    def watch(self, server: FakeOpenAIServer) -> None:
        """Remember every descendant seen (the verifier pool and its resource tracker come and go) and when the
        attempt sent its first model request."""
        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.children.setdefault(child.pid, child)
        except psutil.Error:
            pass
        if self.first_request_s is None and server.stats.chat_requests > self.requests_before:
            self.first_request_s = time.monotonic() - self.started

    def output(self) -> str:
        return self.out.read_text(errors="replace")


def start_attempt(config: Path, run_id: str, env: dict[str, str], out: Path, server: FakeOpenAIServer) -> Attempt:
    argv = [sys.executable, "-m", "application.cli", "train", "--config", str(config), "--run-id", run_id]
    before = server.stats.chat_requests
    with open(out, "w") as handle:
        proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT)
    return Attempt(proc, time.monotonic(), out, before)


def run_until(attempt: Attempt, server: FakeOpenAIServer, done: Callable[[], bool], limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while attempt.proc.poll() is None and not done():
        attempt.watch(server)
        if time.monotonic() > deadline:
            attempt.proc.kill()
            attempt.proc.wait()
            pytest.fail(f"clgrpo train did not finish in {limit_s:.0f} s: {attempt.output()[-4000:]}")
        time.sleep(0.02)
    attempt.watch(server)


def run_to_completion(attempt: Attempt, server: FakeOpenAIServer) -> float:
    """Seconds from the process start to its exit; it must exit 0."""
    run_until(attempt, server, lambda: False, RUN_LIMIT_S)
    took = time.monotonic() - attempt.started
    assert attempt.proc.wait() == 0, attempt.output()[-4000:]
    survivors = survivors_of(attempt, time.monotonic() + ORPHAN_LIMIT_S)
    assert not survivors, f"processes outlived a completed clgrpo train: {survivors}"
    return took


def survivors_of(attempt: Attempt, deadline: float) -> list[str]:
    """Descendants still alive at ``deadline`` (waited for); they are killed, so the next attempt starts clean."""
    pending = list(attempt.children.values())
    while pending and time.monotonic() < deadline:
        pending = [p for p in pending if not gone(p)]
        if pending:
            time.sleep(0.05)
    alive = [p for p in pending if not gone(p)]
    found = [describe(p) for p in alive]
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    return found


# --- the runs ----------------------------------------------------------------------------------------------
def write_config(path: Path, db: Path, dataset: Path, server: FakeOpenAIServer) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "dataset": {"path": str(dataset)},
                "db_path": str(db),
                "policy": {
                    "model": "scripted",
                    "base_url": server.base_url,
                    "api_key_env": None,
                    "seed": POLICY_SEED,
                    "retry_base_delay_s": 0.01,
                    "retry_max_delay_s": 0.05,
                    "timeout_s": 30,
                },
                "grpo": {"group_size": 4, "epochs": 2, "batch_size": 8},
                "concurrency": CONCURRENCY,
            }
        )
    )
    return path


@dataclass
class Reference:
    db: Path
    duration_s: float  # process start to exit
    first_request_s: float  # process start to its first model request
    last_reply_s: float  # process start to the end of its last model request
    requests: int  # chat requests the fake server answered
    distinct: int  # distinct requests among them (SeededWorld.answered)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    # 16 problems, batches of 8, 2 epochs: 4 steps
    where = tmp_path_factory.mktemp("kill-data")
    return write_jsonl(make_problems(n_per_family=4, seed=DATA_SEED), where / "train.jsonl")


@pytest.fixture(scope="module")
def reference(prefect_api, dataset, tmp_path_factory) -> Reference:
    """The uninterrupted run ``ref``, in its own DuckDB file."""
    where = tmp_path_factory.mktemp("kill-ref")
    db = where / "db" / "ref.duckdb"
    with llm_server() as server:
        config = write_config(where / "run.yaml", db, dataset, server)
        attempt = start_attempt(config, "ref", cli_env(prefect_api, where), where / "ref.out", server)
        took = run_to_completion(attempt, server)
        requests = server.stats.chat_requests
        last_reply_s = max(entry.ended for entry in server.stats.log) - attempt.started  # the same clock
        distinct = server.responder.progress()
    assert attempt.first_request_s is not None
    print(
        f"\nreference run: {took:.1f} s (model requests from {attempt.first_request_s:.1f} s to "
        f"{last_reply_s:.1f} s), {requests} model requests, {distinct} distinct"
    )
    return Reference(db, took, attempt.first_request_s, last_reply_s, requests, distinct)


@dataclass
class KillPoint:
    number: int
    kind: str  # work | setup
    offset_s: float
    target: int = 0  # work: distinct requests answered
    delay_s: float | None = None  # process start -> SIGKILL sent
    outcome: str = ""  # killed | finished (rc)
    requests: int = 0  # model requests the attempt sent
    children: int = 0
    reached: str = ""  # from DuckDB after the kill: stored stages, the last one
    journal: str = ""  # lines in the work journal after the kill


def plan_kill_points(n: int, seed: int, ref: Reference) -> list[KillPoint]:
    rng = random.Random(seed)
    kinds = ["setup" if i % 4 == 3 else "work" for i in range(n)]
    targets = iter(sorted(rng.randint(1, ref.distinct) for k in kinds if k == "work"))
    points = []
    for i, kind in enumerate(kinds):
        if kind == "setup":
            points.append(KillPoint(i + 1, kind, rng.uniform(1.0, max(ref.first_request_s, 1.5))))
        else:
            points.append(KillPoint(i + 1, kind, rng.uniform(0.0, WORK_OFFSET_S), next(targets)))
    return points


def duplicates(store: Store, run_id: str) -> dict[str, int]:
    """Rows beyond the first per key, per table (all zero when nothing is duplicated)."""
    found = {}
    for table, key in NO_DUP_KEYS.items():
        columns = ", ".join(key)
        found[table] = int(
            store.query(
                f"SELECT coalesce(sum(n - 1), 0) AS extra FROM (SELECT count(*) AS n FROM {table} WHERE run_id = ? "
                f"GROUP BY {columns})",
                [run_id],
            )["extra"][0]
        )
    return found


def journal_lines(db: Path, db_id: str, run_id: str) -> tuple[int, int]:
    calls = items = 0
    for path in sorted(run_journal_dir(db, db_id, run_id).glob("step-*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            calls += '"t":"call"' in line
            items += '"t":"item"' in line
    return calls, items


def after_kill(point: KillPoint, db: Path, run_id: str) -> None:
    """What the killed attempt left: stored stages, the journal; and nothing duplicated so far."""
    if not db.exists():
        point.reached = "(no database yet)"
        return
    with Store(db, read_only=True) as store:
        stages = store.query("SELECT step, stage FROM stage_runs WHERE run_id = ? ORDER BY completed_at", [run_id])
        last = f"{stages.step.iloc[-1]}/{stages.stage.iloc[-1]}" if len(stages) else "-"
        point.reached = f"{len(stages)} stored, last {last}"
        extra = {t: n for t, n in duplicates(store, run_id).items() if n}
        calls, items = journal_lines(db, store.db_id, run_id)
        point.journal = f"{calls} calls, {items} items"
    assert not extra, f"kill point {point.number}: duplicated rows after the kill: {extra}"


def table(points: list[KillPoint]) -> str:
    head = (
        f"{'#':>3} {'kill at':21} {'delay':>7} {'outcome':10} {'reqs':>4} {'kids':>4}  "
        "stored stages after it (step/stage)"
    )
    lines = [head]
    for p in points:
        at = f"start +{p.offset_s:.2f}s" if p.kind == "setup" else f"request {p.target} +{p.offset_s:.2f}s"
        delay = f"{p.delay_s:6.2f}s" if p.delay_s is not None else "      -"
        lines.append(
            f"{p.number:>3} {at:21} {delay} {p.outcome:10} {p.requests:>4} "
            f"{p.children:>4}  {p.reached}; journal {p.journal}"
        )
    return "\n".join(lines)


def frames(db: Path, run_id: str) -> dict[str, list]:
    """The run's results, comparable between two runs (no timestamps, latencies or call ids)."""
    queries = {
        "stage_runs": "SELECT step, stage FROM stage_runs WHERE run_id = ? ORDER BY step, stage",
        "rollouts_per_step": "SELECT step, count(*) FROM rollouts WHERE run_id = ? GROUP BY step ORDER BY step",
        "rewards_per_step": "SELECT step, count(*) FROM rewards WHERE run_id = ? GROUP BY step ORDER BY step",
        "rollouts": "SELECT step, problem_id, sample_idx, library_version, final_text, error FROM rollouts "
        "WHERE run_id = ? ORDER BY step, problem_id, sample_idx",
        "rewards": "SELECT step, problem_id, sample_idx, reward, verified FROM rewards WHERE run_id = ? "
        "ORDER BY step, problem_id, sample_idx",
        "summaries": "SELECT step, problem_id, sample_idx, text FROM summaries WHERE run_id = ? "
        "ORDER BY step, problem_id, sample_idx",
        "proposals": "SELECT step, stage, group_id, operations_json FROM proposals WHERE run_id = ? "
        "ORDER BY step, stage, group_id",
        "operations": "SELECT step, seq, op, target_ids_json, text, status, result_id FROM operations "
        "WHERE run_id = ? ORDER BY step, seq",
        "library_versions": "SELECT version, step, parent_version, n_experiences, content_hash FROM "
        "library_versions WHERE run_id = ? ORDER BY version",
        "libraries": "SELECT version, position, exp_id, text FROM library_experiences WHERE run_id = ? "
        "ORDER BY version, position",
    }
    with Store(db, read_only=True) as store:
        return {name: [tuple(r) for r in store.con.execute(sql, [run_id]).fetchall()] for name, sql in queries.items()}


def kill_points_scenario(
    n_points: int, seed: int, prefect_api: PrefectApi, dataset: Path, ref: Reference, where: Path
) -> None:
    run_id = "killed"
    db = where / "db" / "killed.duckdb"
    env = cli_env(prefect_api, where)
    points = plan_kill_points(n_points, seed, ref)
    began = time.monotonic()
    with llm_server() as server:  # its own server: its request count is this run's
        world = server.responder
        config = write_config(where / "run.yaml", db, dataset, server)
        for point in points:
            attempt = start_attempt(config, run_id, env, where / f"attempt-{point.number:02d}.out", server)
            if point.kind == "setup":
                target = attempt.started + point.offset_s
                run_until(attempt, server, lambda target=target: time.monotonic() >= target, RUN_LIMIT_S)
            else:
                if world.progress() < point.target:
                    run_until(attempt, server, lambda point=point: world.progress() >= point.target, RUN_LIMIT_S)
                else:  # an earlier attempt got past this point: inside this attempt's first unfinished stage
                    run_until(attempt, server, lambda attempt=attempt: attempt.first_request_s is not None, RUN_LIMIT_S)
                if attempt.proc.poll() is None:
                    target = time.monotonic() + point.offset_s
                    run_until(attempt, server, lambda target=target: time.monotonic() >= target, RUN_LIMIT_S)
            if attempt.proc.poll() is None:
                attempt.proc.send_signal(signal.SIGKILL)
                killed_at, progress = time.monotonic(), world.progress()
                point.delay_s = killed_at - attempt.started
                assert attempt.proc.wait(timeout=60) == -signal.SIGKILL
                point.outcome = "killed"
            else:
                killed_at, progress = time.monotonic(), world.progress()
                point.outcome = f"finished {attempt.proc.returncode}"
                assert attempt.proc.returncode == 0, attempt.output()[-4000:]
            settle = time.monotonic() + ORPHAN_LIMIT_S  # the killed attempt's requests still in the server
            while server.stats.in_flight and time.monotonic() < settle:
                time.sleep(0.02)
            world.forget_after(progress)
            point.requests = server.stats.chat_requests - attempt.requests_before
            point.children = len(attempt.children)
            orphans = survivors_of(attempt, killed_at + ORPHAN_LIMIT_S)
            assert not orphans, (
                f"kill point {point.number}: children of the SIGKILLed CLI alive "
                f"{ORPHAN_LIMIT_S:.0f} s after the kill: {orphans}"
            )
            after_kill(point, db, run_id)

        final = start_attempt(config, run_id, env, where / "final.out", server)
        final_s = run_to_completion(final, server)
        requests = server.stats.chat_requests
    total_s = time.monotonic() - began
    kills = sum(p.outcome == "killed" for p in points)

    with Store(db, read_only=True) as store:
        extra = duplicates(store, run_id)
        calls = int(store.query("SELECT count(*) AS n FROM llm_calls WHERE run_id = ?", [run_id])["n"][0])
        null_ids = int(
            store.query("SELECT count(*) AS n FROM llm_calls WHERE run_id = ? AND call_id IS NULL", [run_id])["n"][0]
        )
        status = store.runs().set_index("run_id").loc[run_id, "status"]
        steps = store.steps_done(run_id)
        versions = store.library_versions(run_id)
        ops = store.query(
            "SELECT step, seq, count(*) AS n FROM operations WHERE run_id = ? GROUP BY step, seq", [run_id]
        )
        experiences = store.query(
            "SELECT version, count(*) AS n, count(DISTINCT exp_id) AS d "
            "FROM library_experiences WHERE run_id = ? GROUP BY version",
            [run_id],
        )
        journal = run_journal_dir(db, store.db_id, run_id)
    with Store(ref.db, read_only=True) as store:
        ref_calls = int(store.query("SELECT count(*) AS n FROM llm_calls WHERE run_id = 'ref'")["n"][0])
    ref_frames, killed_frames = frames(ref.db, "ref"), frames(db, run_id)
    runs = flow_runs_of(prefect_api, db)

    print(f"\n{n_points} kill points (seed {seed}): {kills} killed, {n_points - kills} finished before the kill")
    print(table(points))
    print(f"reference: {ref.duration_s:.1f} s, {ref.requests} model requests, {ref_calls} llm_calls rows")
    print(
        f"killed run: {total_s:.1f} s over {len(points) + 1} attempts (final rerun {final_s:.1f} s); "
        f"{requests} model requests, {calls} llm_calls rows; {requests - calls} requests unrecorded "
        f"(bound: {kills} kills x concurrency {CONCURRENCY} = {kills * CONCURRENCY})"
    )
    print(f"flow runs of the killed run: {sorted(r['state'] for r in runs)}")

    # 1. no duplicate keys
    assert not {t: n for t, n in extra.items() if n}, extra
    assert null_ids == 0, f"{null_ids} llm_calls rows without a call_id"
    # 2. no operation applied twice
    assert (ops["n"] == 1).all(), ops[ops["n"] > 1]
    assert (experiences["n"] == experiences["d"]).all(), experiences
    assert len(versions) == steps + 1 and versions == list(range(steps + 1)), (versions, steps)
    # 3. the same structure and counts as the uninterrupted run; with the seeded world, the same results
    for name in (
        "stage_runs",
        "rollouts_per_step",
        "rewards_per_step",
        "library_versions",
        "libraries",
        "operations",
        "proposals",
        "rollouts",
        "rewards",
        "summaries",
    ):
        assert killed_frames[name] == ref_frames[name], f"{name} differs from the uninterrupted run's"
    assert steps == 4
    # 4. every request accounted, within the calls in flight at a kill
    assert ref_calls == ref.requests, "the uninterrupted run did not record exactly its requests"
    assert calls <= requests
    assert requests - calls <= kills * CONCURRENCY, (requests, calls, kills)
    # 5. completed, and the work journal is gone
    assert status == "completed"
    assert not journal.exists(), sorted(p.name for p in journal.rglob("*"))
    # the flow runs the kills left Running were marked Crashed by the reruns
    assert runs and all(r["state"] in ("CRASHED", "COMPLETED") for r in runs), runs
    # (a kill can land after its flow run completed, before the process exited: then it counts as completed too)
    assert sum(r["state"] == "COMPLETED" for r in runs) >= 1 + sum(p.outcome.startswith("finished") for p in points)


def test_sigkill_at_3_seeded_points_then_resume_matches_the_uninterrupted_run(
    prefect_api, dataset, reference, tmp_path
):
    kill_points_scenario(3, seed=11, prefect_api=prefect_api, dataset=dataset, ref=reference, where=tmp_path)


@pytest.mark.long
def test_sigkill_at_16_seeded_points_then_resume_matches_the_uninterrupted_run(
    prefect_api, dataset, reference, tmp_path
):
    kill_points_scenario(16, seed=23, prefect_api=prefect_api, dataset=dataset, ref=reference, where=tmp_path)
