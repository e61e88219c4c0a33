"""Inspecting runs while they train: real processes on a real DuckDB file.

A ``Store`` holds the file only while a method works, so readers in other processes (``clgrpo runs list``) and
other runs on the same file get their turn; one live process per run id is the run lock's job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from clgrpo.storage.run_lock import RunLock, RunLockedError, holder, lock_path, refuse_if_running
from clgrpo.storage.store import Store
from clgrpo.testing.fake_openai import FakeOpenAIServer
from clgrpo.testing.scripted_llm import ScriptedWorld, make_problems, write_jsonl
from tests.test_kill_points import cli_env, write_config

ROOT = Path(__file__).resolve().parents[1]

WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from clgrpo.storage.store import Store
    from schemas.records import Rollout, Turn

    db, run_id, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    rows = [Rollout(problem_id=f"p{{i}}", sample_idx=0, prompt_hash="h", library_version=0,
                    turns=[Turn(kind="assistant", content="x" * 400)], tokens_in=1, tokens_out=1, latency_s=0.0)
            for i in range(32)]
    store = Store(db)
    steps, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        steps += 1
        store.write_stage(run_id, steps, "rollout", {{"rollouts": rows}})
        store.set_run_status(run_id, "running")
    store.close()
    print(steps)
""").format(root=str(ROOT))


def start_writer(db: Path, run_id: str, seconds: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(db), run_id, str(seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_readers_get_in_between_the_writes_of_two_runs_on_one_file(tmp_path):
    db = tmp_path / "shared.duckdb"
    Store(db).close()
    writers = [start_writer(db, run_id, seconds=4.0) for run_id in ("a", "b")]  # two runs write at once
    reads, slowest = 0, 0.0
    while any(w.poll() is None for w in writers):
        started = time.monotonic()
        with Store(db, read_only=True) as store:  # opens (and retries) per call, as a CLI command does
            store.runs()
            store.stage_done("a", 1, "rollout")
        slowest = max(slowest, time.monotonic() - started)
        reads += 1
    outputs = [w.communicate(timeout=60) for w in writers]
    assert [w.returncode for w in writers] == [0, 0], [err[-2000:] for _, err in outputs]
    steps = [int(out) for out, _ in outputs]
    with Store(db, read_only=True) as store:
        stored = store.query("SELECT run_id, count(*) AS n FROM stage_runs GROUP BY run_id ORDER BY run_id")
    assert stored["n"].tolist() == steps and min(steps) >= 5, steps  # both runs wrote, every write is stored
    assert reads >= 5 and slowest < 5.0, (reads, slowest)
    print(f"\n{reads} reads between {sum(steps)} stage writes of 2 runs; slowest read {slowest * 1000:.0f} ms")


# --- the run lock ------------------------------------------------------------------------------------------
HOLDER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from clgrpo.storage.run_lock import RunLock
    with RunLock(sys.argv[1], "train", "r1"):
        print("held", flush=True)
        time.sleep(60)
""").format(root=str(ROOT))


def test_the_run_lock_names_its_live_owner_and_dies_with_it(tmp_path, capsys):
    from application.cli import main

    db = tmp_path / "runs.duckdb"
    with Store(db) as store, store.connected() as con:
        con.execute(
            "INSERT INTO runs (run_id, fingerprint, config_json, created_at, status) "
            "VALUES ('r1', 'f', '{}', now(), 'running')"
        )
    assert holder(db, "train", "r1") is None
    owner = subprocess.Popen([sys.executable, "-c", HOLDER, str(db)], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "held"
        found = holder(db, "train", "r1")
        assert found is not None and found.pid == owner.pid
        assert main(["runs", "list", "--db", str(db)]) == 0
        assert f"running (pid {owner.pid})" in capsys.readouterr().out
        assert main(["runs", "delete", "r1", "--yes", "--db", str(db)]) == 2  # never under a live run
        assert f"error: run r1 is being trained by process {owner.pid}" in capsys.readouterr().err
        with pytest.raises(
            RunLockedError,
            match=rf"^run r1 is being trained by process {owner.pid} \(started "
            rf".+\); wait for it or stop it \(kill {owner.pid}\)$",
        ):
            refuse_if_running(db, "train", "r1")
        with pytest.raises(RunLockedError):
            RunLock(db, "train", "r1").acquire()
        with RunLock(db, "train", "r2"), RunLock(db, "eval", "r1"):  # other ids (and kinds) are free
            assert holder(db, "train", "r2").pid == os.getpid()
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
    assert holder(db, "train", "r1") is None  # the kernel let go of it
    assert main(["runs", "show", "r1", "--db", str(db)]) == 0
    shown = capsys.readouterr().out
    assert "status:      interrupted" in shown and "last stage:  none stored yet" in shown, shown
    with RunLock(db, "train", "r1"):
        assert lock_path(db, "train", "r1").read_text().split()[0] == str(os.getpid())
    assert lock_path(db, "train", "r1").read_text() == ""  # released: no owner named


# --- a real `clgrpo train` inspected while it trains ----------------------------------------------------------
READERS = {  # command -> what its output must show
    "runs list": ["runs", "list"],
    "runs show": ["runs", "show", "live"],
    "library show": ["library", "show", "live"],
    "library ops": ["library", "ops", "live"],
}
# a reader the writer blocked gives up after the store's READ_WAIT_S (10 s) and exits non-zero, which the test
# checks first; the wall limit only catches a gross slowdown: four CLI processes start at once, and on a loaded
# 2-core machine that alone took 13 s
READER_LIMIT_S = 30.0


def clgrpo(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "application.cli", *args],
        env=env,
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def wait_for(condition, what: str, proc: subprocess.Popen, out: Path, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"{what}: not reached (train exit {proc.poll()}): {out.read_text()[-3000:]}")
        time.sleep(0.1)


def finish_times(procs: dict[str, subprocess.Popen], started: float, limit_s: float) -> dict[str, float]:
    """Seconds from ``started`` to each process's exit (their output is small: the pipes do not fill)."""
    took: dict[str, float] = {}
    while len(took) < len(procs) and time.monotonic() - started < limit_s:
        for name, proc in procs.items():
            if name not in took and proc.poll() is not None:
                took[name] = time.monotonic() - started
        time.sleep(0.02)
    return {name: took.get(name, float("inf")) for name in procs}


def stored_step(db: Path) -> bool:
    try:
        with Store(db, read_only=True) as store:
            return bool(store.library_versions("live")) and store.stage_done("live", 1, "rollout")
    except Exception:  # noqa: BLE001 - not created yet
        return False


@pytest.mark.integration
def test_a_training_run_can_be_inspected_and_is_not_trained_twice(prefect_api, tmp_path):
    dataset = write_jsonl(make_problems(n_per_family=4, seed=5), tmp_path / "train.jsonl")
    db = tmp_path / "db" / "live.duckdb"
    env = cli_env(prefect_api, tmp_path)
    out = tmp_path / "train.out"
    with FakeOpenAIServer(ScriptedWorld(seed=2), latency=lambda _request: 0.6) as server:
        config = write_config(tmp_path / "run.yaml", db, dataset, server)
        with open(out, "w") as handle:
            train = subprocess.Popen(
                [sys.executable, "-m", "application.cli", "train", "--config", str(config), "--run-id", "live"],
                env=env,
                cwd=ROOT,
                stdout=handle,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_for(lambda: stored_step(db), "the first rollouts stored", train, out)
            started = time.monotonic()
            readers = {name: clgrpo(*argv, "--db", str(db), env=env) for name, argv in READERS.items()}
            second = clgrpo("train", "--config", str(config), "--run-id", "live", env=env)
            took = finish_times({**readers, "second train": second}, started, limit_s=60)
            answers = {
                name: (p, *p.communicate(timeout=10), took[name])
                for name, p in {**readers, "second train": second}.items()
            }
            assert train.poll() is None, "the run ended before the readers were done: make it longer"
            for name, (proc, _stdout, stderr, took) in answers.items():
                if name == "second train":
                    continue
                assert proc.returncode == 0, f"{name}: {stderr[-2000:]}"
                assert took < READER_LIMIT_S, f"{name} took {took:.1f} s"
            assert f"running (pid {train.pid})" in answers["runs list"][1]
            shown = answers["runs show"][1]
            assert f"status:      running (pid {train.pid}, since " in shown and "last stage:  step " in shown
            assert "# run live, version " in answers["library show"][1]
            assert "# run live, " in answers["library ops"][1]
            proc, stdout, stderr, took = answers["second train"]
            assert proc.returncode == 2 and stderr.strip().splitlines() == [
                f"error: run live is being trained by process {train.pid} (started "
                f"{holder(db, 'train', 'live').started}); wait for it or stop it (kill {train.pid})"
            ], stderr
            print("\nwhile training: " + ", ".join(f"{name} {a[3]:.1f} s" for name, a in answers.items()))
            assert train.wait(timeout=300) == 0, out.read_text()[-4000:]
        finally:
            if train.poll() is None:
                train.kill()
                train.wait()
    finished = subprocess.run(
        [sys.executable, "-m", "application.cli", "runs", "show", "live", "--db", str(db)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "status:      completed" in finished.stdout and "steps done:  4" in finished.stdout, finished
