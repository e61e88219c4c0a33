"""SIGTERM, SIGINT and SIGHUP stop a real `clgrpo train --mode agent` cleanly at seeded points, and the run
then resumes to the same library as an uninterrupted run.

Each stop: exit 128 + signal within STOP_LIMIT_S of the signal, exactly one ``error: terminated (SIG...)``
line, no traceback, the flow run Cancelled (never Crashed or left Running), the run listed as ``cancelled``, no
process of the attempt alive and no sandbox directory left in its TMPDIR. Then a rerun completes and its
results equal the uninterrupted reference run's (rollouts, rewards, proposals, operations, every library
version), with no duplicated row.

Points (seeded): ``interpreters``: once the sandbox's python interpreters are alive (its directories exist),
mid-rollout; ``setup``: between the process start and its first model request (imports, preflight, the
Prefect flow run, reading stored stages back); ``work``: after a seeded number of distinct model requests,
plus up to 0.5 s (learner stages, stage writes). The scripted model is ``SeededWorld`` (tests/test_kill_points.py):
a redone request gets the same reply, so the resumed run can be compared with the reference.
"""

from __future__ import annotations

import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from clgrpo.storage.store import Store
from clgrpo.testing.scripted_llm import make_problems, write_jsonl
from tests.processes import PrefectApi
from tests.test_kill_points import (
    ORPHAN_LIMIT_S,
    POLICY_SEED,
    RUN_LIMIT_S,
    Attempt,
    cli_env,
    dataset,  # noqa: F401 - a fixture
    duplicates,
    flow_runs_of,
    frames,
    llm_server,
    reference,  # noqa: F401 - a fixture
    run_to_completion,
    run_until,
    start_attempt,
    survivors_of,
    write_config,
)

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
STOP_LIMIT_S = 10.0  # signal -> exit
SANDBOX_PREFIX = "clgrpo-py-"


@dataclass
class StopPoint:
    number: int
    kind: str  # interpreters | setup | work
    sig: signal.Signals
    offset_s: float
    target: int = 0  # work: distinct requests answered
    outcome: str = ""
    exit_s: float | None = None
    line: str = ""


def sandbox_tmpdir() -> Path:
    """A TMPDIR of its own that uid nobody (the sandbox's interpreters) can enter."""
    path = Path(tempfile.mkdtemp(prefix="clgrpo-stoptest-"))
    path.chmod(0o755)
    return path


def sandbox_dirs(tmpdir: Path) -> list[str]:
    return sorted(p.name for p in tmpdir.glob(f"{SANDBOX_PREFIX}*"))


def agent_config(path: Path, db: Path, dataset: Path, base_url: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "dataset": {"path": str(dataset)},
                "db_path": str(db),
                "policy": {
                    "model": "scripted",
                    "base_url": base_url,
                    "api_key_env": None,
                    "seed": POLICY_SEED,
                    "retry_base_delay_s": 0.01,
                    "retry_max_delay_s": 0.05,
                    "timeout_s": 30,
                },
                "grpo": {"group_size": 4, "epochs": 2, "batch_size": 8},
                "rollout": {"mode": "agent", "agent": {"max_turns": 4}},
                "concurrency": 8,
            }
        )
    )
    return path


@pytest.fixture(scope="module")
def agent_dataset(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("stop-data")
    return write_jsonl(make_problems(n_per_family=4, seed=5), where / "train.jsonl")  # 16 problems: 4 steps


@dataclass
class AgentReference:
    db: Path
    first_request_s: float
    distinct: int


@pytest.fixture(scope="module")
def agent_reference(prefect_api: PrefectApi, agent_dataset, tmp_path_factory) -> AgentReference:
    where = tmp_path_factory.mktemp("stop-ref")
    db = where / "db" / "ref.duckdb"
    tmpdir = sandbox_tmpdir()
    try:
        with llm_server() as server:
            config = agent_config(where / "run.yaml", db, agent_dataset, server.base_url)
            env = {**cli_env(prefect_api, where), "TMPDIR": str(tmpdir)}
            attempt = start_attempt(config, "ref", env, where / "ref.out", server)
            run_to_completion(attempt, server)
            distinct = server.responder.progress()
        assert attempt.first_request_s is not None
        assert not sandbox_dirs(tmpdir), "a completed run left sandbox directories"
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return AgentReference(db, attempt.first_request_s, distinct)


def plan_stop_points(kinds: list[str], sigs: list[signal.Signals], seed: int, ref: AgentReference) -> list[StopPoint]:
    rng = random.Random(seed)
    targets = iter(sorted(rng.randint(ref.distinct // 4, ref.distinct) for k in kinds if k == "work"))
    points = []
    for i, (kind, sig) in enumerate(zip(kinds, sigs, strict=True)):
        if kind == "setup":
            points.append(StopPoint(i + 1, kind, sig, rng.uniform(1.0, max(ref.first_request_s, 1.5))))
        elif kind == "interpreters":
            points.append(StopPoint(i + 1, kind, sig, rng.uniform(0.0, 0.3)))
        else:
            points.append(StopPoint(i + 1, kind, sig, rng.uniform(0.0, 0.5), next(targets)))
    return points


def wait_for_point(point: StopPoint, attempt: Attempt, server, tmpdir: Path) -> None:
    world = server.responder
    if point.kind == "setup":
        at = attempt.started + point.offset_s
        run_until(attempt, server, lambda: time.monotonic() >= at, RUN_LIMIT_S)
        return
    if point.kind == "interpreters":
        run_until(attempt, server, lambda: bool(sandbox_dirs(tmpdir)), RUN_LIMIT_S)
    elif world.progress() < point.target:
        run_until(attempt, server, lambda: world.progress() >= point.target, RUN_LIMIT_S)
    else:  # an earlier attempt got past the target: inside this attempt's first unfinished stage
        run_until(attempt, server, lambda: attempt.first_request_s is not None, RUN_LIMIT_S)
    at = time.monotonic() + point.offset_s
    run_until(attempt, server, lambda: time.monotonic() >= at, RUN_LIMIT_S)


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def check_stopped(point: StopPoint, attempt: Attempt, tmpdir: Path) -> None:
    output = attempt.output()
    lines = error_lines(output)
    assert len(lines) == 1, f"stop point {point.number}: {len(lines)} error lines:\n{output[-3000:]}"
    point.line = lines[0]
    assert f"terminated ({point.sig.name})" in lines[0], lines[0]
    assert "resume with: clgrpo train" in lines[0] and "--run-id stopped" in lines[0], lines[0]
    assert "Traceback" not in output, output[-3000:]
    orphans = survivors_of(attempt, time.monotonic() + ORPHAN_LIMIT_S)
    assert not orphans, f"stop point {point.number}: processes outlived the stopped CLI: {orphans}"
    assert not sandbox_dirs(tmpdir), f"stop point {point.number}: left {sandbox_dirs(tmpdir)}"


def runs_list(env: dict[str, str], db: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "application.cli", "runs", "list", "--db", str(db)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def stop_points_scenario(
    points: list[StopPoint], prefect_api: PrefectApi, dataset: Path, ref: AgentReference, where: Path
) -> None:
    run_id = "stopped"
    db = where / "db" / "stopped.duckdb"
    tmpdir = sandbox_tmpdir()
    env = {**cli_env(prefect_api, where), "TMPDIR": str(tmpdir)}
    listed = ""
    try:
        with llm_server() as server:
            config = agent_config(where / "run.yaml", db, dataset, server.base_url)
            for point in points:
                attempt = start_attempt(config, run_id, env, where / f"attempt-{point.number:02d}.out", server)
                wait_for_point(point, attempt, server, tmpdir)
                progress = server.responder.progress()
                if attempt.proc.poll() is not None:
                    point.outcome = f"finished {attempt.proc.returncode}"
                    assert attempt.proc.returncode == 0, attempt.output()[-4000:]
                    continue
                sent = time.monotonic()
                attempt.proc.send_signal(point.sig)
                try:
                    rc = attempt.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    attempt.proc.kill()
                    pytest.fail(f"stop point {point.number}: still running 60 s after {point.sig.name}")
                point.exit_s = time.monotonic() - sent
                point.outcome = f"exit {rc}"
                settle = time.monotonic() + ORPHAN_LIMIT_S  # requests the stopped attempt left in the server
                while server.stats.in_flight and time.monotonic() < settle:
                    time.sleep(0.02)
                server.responder.forget_after(progress)
                assert rc == 128 + point.sig, f"stop point {point.number}: exit {rc}\n{attempt.output()[-3000:]}"
                assert point.exit_s <= STOP_LIMIT_S, f"stop point {point.number}: exited {point.exit_s:.1f} s after"
                check_stopped(point, attempt, tmpdir)
                states = {r["state"] for r in flow_runs_of(prefect_api, db)}
                assert states <= {"CANCELLED", "COMPLETED"}, f"stop point {point.number}: flow runs {states}"
                if db.exists():
                    with Store(db, read_only=True) as store:
                        runs = store.runs().set_index("run_id")
                    if run_id in runs.index:
                        assert runs.loc[run_id, "status"] == "cancelled", runs.loc[run_id].to_dict()
                        if not listed:
                            listed = runs_list(env, db)
            final = start_attempt(config, run_id, env, where / "final.out", server)
            run_to_completion(final, server)
        assert not sandbox_dirs(tmpdir)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)

    print(f"\n{len(points)} stop points:")
    for p in points:
        took = f"{p.exit_s:.2f} s" if p.exit_s is not None else "-"
        print(f"{p.number:>3} {p.kind:12} {p.sig.name:7} {p.outcome:9} {took:>7}  {p.line[:110]}")
    stopped = [p for p in points if p.exit_s is not None]
    assert stopped, "no attempt was stopped"
    if listed:
        assert re.search(rf"{run_id}\s+cancelled", listed), listed
    with Store(db, read_only=True) as store:
        assert not {t: n for t, n in duplicates(store, run_id).items() if n}
        assert store.runs().set_index("run_id").loc[run_id, "status"] == "completed"
    ours, theirs = frames(db, run_id), frames(ref.db, "ref")
    for name in (
        "stage_runs",
        "library_versions",
        "libraries",
        "operations",
        "proposals",
        "rollouts",
        "rewards",
        "summaries",
    ):
        assert ours[name] == theirs[name], f"{name} differs from the uninterrupted run's"
    states = sorted(r["state"] for r in flow_runs_of(prefect_api, db))
    assert states.count("COMPLETED") >= 1 and set(states) <= {"CANCELLED", "COMPLETED"}, states


@pytest.mark.long  # about 30 s or more; a shorter test of the same guarantee stays in the default run
def test_sigterm_sigint_sighup_stop_an_agent_run_cleanly_and_it_resumes_to_the_same_library(
    prefect_api, agent_dataset, agent_reference, tmp_path
):
    points = plan_stop_points(
        ["interpreters", "setup", "work"], [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], seed=5, ref=agent_reference
    )
    stop_points_scenario(points, prefect_api, agent_dataset, agent_reference, tmp_path)


@pytest.mark.long
def test_ten_sigterms_at_seeded_points_of_an_agent_run(prefect_api, agent_dataset, agent_reference, tmp_path):
    kinds = ["interpreters", "work", "setup", "work", "interpreters", "work", "setup", "work", "interpreters", "work"]
    points = plan_stop_points(kinds, [signal.SIGTERM] * len(kinds), seed=17, ref=agent_reference)
    stop_points_scenario(points, prefect_api, agent_dataset, agent_reference, tmp_path)


# --- in-process models: generation in a worker thread stops at the first signal -----------------------------
def tiny_model_config(path: Path, db: Path, dataset: Path, model: Path) -> Path:
    local = {
        "backend": "transformers",
        "model": "tiny",
        "model_path": str(model),
        "api_key_env": None,
        "temperature": 1.0,
        "max_tokens": 600,
        "timeout_s": 900,
        "max_retries": 0,
        "cpu_threads": 1,
    }
    path.write_text(
        yaml.safe_dump(
            {
                "dataset": {"path": str(dataset)},
                "db_path": str(db),
                "policy": {**local, "max_batch_rows": 64},
                "learner": local,
                "grpo": {"group_size": 8, "epochs": 1, "batch_size": 8},
                "concurrency": 64,
                "pipeline": False,
            }
        )
    )
    return path


def test_sigterm_stops_an_in_process_model_run_within_seconds(prefect_api, tmp_path):
    """Three SIGTERMs to `clgrpo train` with the transformers backend (a tiny random model, long replies):
    as the rollout stage starts (the model loading), and twice inside the first batched generate call, which
    checks for a stop between two tokens."""
    pytest.importorskip("torch", reason="the local extra (torch, transformers) is not installed")
    from tests.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    dataset = write_jsonl(make_problems(n_per_family=2, seed=3), tmp_path / "train.jsonl")
    config = tiny_model_config(tmp_path / "run.yaml", tmp_path / "db" / "tiny.duckdb", dataset, model)
    env = cli_env(prefect_api, tmp_path)
    log = tmp_path / "db" / "logs" / "tiny.log"
    results = []
    # (what to wait for, then how long): the model loading, then inside its first batched generate call
    points = [("rollout", 0.0), ("loaded", 0.2), ("loaded", 0.8)]
    for number, (marker, wait_s) in enumerate(points, start=1):
        loads_before = log.read_text(errors="replace").count(": loaded in ") if log.exists() else 0
        out = tmp_path / f"attempt-{number}.out"
        argv = [sys.executable, "-m", "application.cli", "train", "--config", str(config), "--run-id", "tiny"]
        with open(out, "w") as handle:
            proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + RUN_LIMIT_S

        def reached(marker: str = marker, out: Path = out, loads_before: int = loads_before) -> bool:
            if marker == "rollout":
                return "step 1 rollout: started" in out.read_text(errors="replace")
            return log.exists() and log.read_text(errors="replace").count(": loaded in ") > loads_before

        while not reached():
            assert proc.poll() is None, out.read_text()[-3000:]
            assert time.monotonic() < deadline, f"attempt {number}: never reached {marker}"
            time.sleep(0.02)
        time.sleep(wait_s)
        assert proc.poll() is None, f"attempt {number} finished before its signal: {out.read_text()[-2000:]}"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        took = time.monotonic() - sent
        output = out.read_text(errors="replace")
        results.append((number, marker, wait_s, rc, round(took, 2)))
        assert rc == 143 and took <= STOP_LIMIT_S, (rc, took, output[-3000:])
        lines = error_lines(output)
        assert len(lines) == 1 and "terminated (SIGTERM) during step 1 rollout" in lines[0], output[-3000:]
        assert "Traceback" not in output
    print("\nin-process model, SIGTERM (attempt, after what, + seconds, exit, seconds to exit):", results)
    states = {r["state"] for r in flow_runs_of(prefect_api, tmp_path / "db" / "tiny.duckdb")}
    assert states == {"CANCELLED"}, states
    with Store(tmp_path / "db" / "tiny.duckdb", read_only=True) as store:
        assert store.runs().set_index("run_id").loc["tiny", "status"] == "cancelled"


# --- a signal during a stage write: the write finishes, then the run stops ----------------------------------
SLOW_WRITE_DRIVER = """
import pathlib, sys, time
from clgrpo.storage.store import Store

marker = pathlib.Path(sys.argv.pop(1))
insert = Store._insert

def slow_insert(self, table, frame):
    if table == "summaries" and not marker.exists():
        marker.write_text("writing")
        time.sleep(1.5)  # the test's SIGTERM lands here, inside the stage's transaction
    return insert(self, table, frame)

Store._insert = slow_insert
sys.argv[0] = "clgrpo"
from application.cli import run
run()
"""


def test_sigterm_during_a_stage_write_lets_the_write_finish_then_stops(prefect_api, dataset, reference, tmp_path):
    """`clgrpo train` in a driver that makes the first summaries write take 1.5 s: SIGTERM inside that
    transaction. The stage is stored whole (its marker's row count equals its rows), the command exits 143
    with its line, and the resumed run equals the uninterrupted one."""
    db = tmp_path / "db" / "written.duckdb"
    marker = tmp_path / "writing"
    driver = tmp_path / "driver.py"
    driver.write_text(SLOW_WRITE_DRIVER)
    env = cli_env(prefect_api, tmp_path)
    with llm_server() as server:
        config = write_config(tmp_path / "run.yaml", db, dataset, server)
        argv = [sys.executable, str(driver), str(marker), "train", "--config", str(config), "--run-id", "written"]
        out = tmp_path / "attempt.out"
        with open(out, "w") as handle:
            proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + RUN_LIMIT_S
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.02)
        progress = server.responder.progress()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        output = out.read_text(errors="replace")
        assert rc == 143, output[-3000:]
        lines = error_lines(output)
        assert len(lines) == 1 and "terminated (SIGTERM) during step 1 " in lines[0], output[
            -3000:
        ]  # the stage after it
        assert "Traceback" not in output
        with Store(db, read_only=True) as store:
            marked = store.query(
                "SELECT n_rows FROM stage_runs WHERE run_id='written' AND step=1 AND stage='summarize'"
            )
            stored = store.query(
                "SELECT (SELECT count(*) FROM summaries WHERE run_id='written' AND step=1) + "
                "(SELECT count(*) FROM llm_calls WHERE run_id='written' AND step=1 "
                "AND stage='summarize') AS n"
            )
            assert store.runs().set_index("run_id").loc["written", "status"] == "cancelled"
        assert len(marked) == 1 and int(marked["n_rows"][0]) == int(stored["n"][0]) > 0
        while server.stats.in_flight:
            time.sleep(0.02)
        server.responder.forget_after(progress)
        final = start_attempt(config, "written", env, tmp_path / "final.out", server)
        run_to_completion(final, server)
    ours, theirs = frames(db, "written"), frames(reference.db, "ref")
    for name in ("stage_runs", "library_versions", "libraries", "operations", "rollouts", "summaries"):
        assert ours[name] == theirs[name], f"{name} differs from the uninterrupted run's"
