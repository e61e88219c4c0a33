"""A SIGKILLed run leaves nothing behind: Prefect's temporary server dies with the process that started it
(``application.prefect_server``), and resuming the run marks the flow run the killed process left Running as
Crashed (``clgrpo.storage.stale_runs``)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from application import prefect_server
from clgrpo.storage.stale_runs import mark_stale_runs_crashed
from clgrpo.testing.fake_openai import ChatRequest, FakeOpenAIServer, role_of
from clgrpo.testing.scripted_llm import ScriptedWorld, make_problems, write_jsonl
from tests.processes import free_port, gone

ROOT = Path(__file__).resolve().parents[1]
ORPHAN_LIMIT_S = 10.0


# --- helpers ------------------------------------------------------------------------------------------
def wait_gone(proc: psutil.Process, limit_s: float) -> float | None:
    """Seconds until ``proc`` exited, None if it outlived ``limit_s``."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        if gone(proc):
            return time.monotonic() - started
        time.sleep(0.05)
    return None


def wait_for(predicate, limit_s: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) before {what}")
        time.sleep(0.1)
    raise AssertionError(f"timed out after {limit_s:.0f} s waiting for {what}")


def prefect_servers(pid: int) -> list[psutil.Process]:
    """Prefect's temporary API servers among the descendants of ``pid``."""
    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "prefect.server.api.server:create_app" in cmdline:
            found.append(child)
    return found


def kill_all(procs: list[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass


# --- the launcher, without Prefect (seconds) --------------------------------------------------------------
ASGI_APP = """
async def app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})
"""


def launcher_args(app_dir: Path, port: int, parent_pid: int | str) -> list[str]:
    return [
        sys.executable,
        prefect_server.LAUNCHER,
        "--parent-pid",
        str(parent_pid),
        "--app-dir",
        str(app_dir),
        "app:app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "error",
        "--lifespan",
        "off",
    ]


def serving(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def test_the_launcher_dies_with_its_parent(tmp_path):
    (tmp_path / "app.py").write_text(ASGI_APP)
    port = free_port()
    parent_code = textwrap.dedent(f"""
        import os, subprocess, sys, time
        args = {launcher_args(tmp_path, port, "PARENT")!r}
        args[args.index("PARENT")] = str(os.getpid())
        child = subprocess.Popen(args)
        print(child.pid, flush=True)
        time.sleep(300)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    server = psutil.Process(int(parent.stdout.readline()))
    try:
        wait_for(lambda: serving(port), 30, "the server to listen", parent)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        took = wait_gone(server, ORPHAN_LIMIT_S)
        assert took is not None, f"the server outlived its SIGKILLed parent by {ORPHAN_LIMIT_S:.0f} s"
        assert took < prefect_server.CHECK_INTERVAL_S + prefect_server.STOP_GRACE_S + 1.0
    finally:
        kill_all([server])
        parent.stdout.close()


def test_the_launcher_notices_a_parent_gone_before_it_started(tmp_path):
    (tmp_path / "app.py").write_text(ASGI_APP)
    # this process is not the launcher's parent any more than a dead pid is: the watchdog stops it at once
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    proc = subprocess.Popen(launcher_args(tmp_path, free_port(), dead.pid))
    try:
        proc.wait(timeout=ORPHAN_LIMIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            pytest.fail("the launcher kept running without its parent")


def test_the_launcher_keeps_uvicorns_exit_code_for_a_port_in_use(tmp_path):
    """Prefect picks another port when the server exits with 3 (uvicorn's startup failure)."""
    (tmp_path / "app.py").write_text(ASGI_APP)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = subprocess.run(
            launcher_args(tmp_path, taken.getsockname()[1], os.getpid()), capture_output=True, timeout=60
        )
    assert proc.returncode == 3, proc.stderr.decode()[-2000:]


def test_install_rewrites_only_prefects_server_command_and_is_idempotent():
    from prefect.server.api import server as prefect_api_server

    command = [
        sys.executable,
        "-m",
        "uvicorn",
        "--app-dir",
        "/x",
        "--factory",
        "prefect.server.api.server:create_app",
        "--port",
        "8123",
    ]
    assert prefect_server.launch_args(command, 42) == [
        sys.executable,
        prefect_server.LAUNCHER,
        "--parent-pid",
        "42",
        *command[3:],
    ]
    assert prefect_server.launch_args([sys.executable, "-m", "uvicorn", "other:app"], 42) is None
    assert prefect_server.launch_args([sys.executable, "-c", "pass"], 42) is None

    assert prefect_server.install() and prefect_server.install() and prefect_server.installed()
    method = prefect_api_server.SubprocessASGIServer._run_uvicorn_command
    assert not getattr(method.__wrapped__, "_clgrpo_parent_bound", False)  # wrapped once, not twice
    module = prefect_api_server.subprocess
    assert module.TimeoutExpired is subprocess.TimeoutExpired and module.PIPE == subprocess.PIPE
    # outside _run_uvicorn_command the Popen Prefect's module sees is plain
    proc = module.Popen(
        [sys.executable, "-c", "import sys; print(sys.argv)", "-m", "uvicorn"], stdout=subprocess.PIPE, text=True
    )
    assert proc.communicate(timeout=60)[0].strip() == "['-c', '-m', 'uvicorn']"


# --- mark_stale_runs_crashed against the test harness -------------------------------------------------------
@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_stale_runs_of_the_same_name_and_database_are_marked_crashed(tmp_path):
    from prefect import flow, task
    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Pending, Running

    @flow(name="stale-probe")
    def probe() -> None:
        pass

    @task(name="stale-probe-task")
    def step() -> None:
        pass

    db, other_db = tmp_path / "runs.duckdb", tmp_path / "other.duckdb"
    name = f"train-stale-{os.getpid()}-{time.monotonic_ns()}"
    params = {"config": {"run_id": name, "db_path": str(db)}}
    async with get_client() as client:

        async def make(state, parameters=params, run_name=name):
            return await client.create_flow_run(probe, name=run_name, parameters=parameters, state=state)

        left_running, left_pending, current = await make(Running()), await make(Pending()), await make(Running())
        elsewhere = await make(Running(), {"config": {"run_id": name, "db_path": str(other_db)}})
        finished = await make(Completed())
        other_name = await make(Running(), run_name=name + "-x")
        task_run = await client.create_task_run(step, left_running.id, dynamic_key="0", state=Running())

        marked = await mark_stale_runs_crashed(name, current.id, db_path=db, run_id=name, flow_name="stale-probe")
        assert marked == 2

        async def state_of(run):
            return (await client.read_flow_run(run.id)).state

        for run in (left_running, left_pending):
            state = await state_of(run)
            assert state.is_crashed() and "the process running it was killed" in state.message
            assert f"found stale when run {name} was resumed" in state.message
        assert (await client.read_task_run(task_run.id)).state.is_crashed()
        assert (await state_of(current)).is_running()
        assert (await state_of(elsewhere)).is_running()  # another database: that run may be alive
        assert (await state_of(finished)).is_completed()
        assert (await state_of(other_name)).is_running()
        # nothing left to mark
        assert await mark_stale_runs_crashed(name, current.id, db_path=db, flow_name="stale-probe") == 0


async def test_stale_run_marking_never_raises():
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api", PREFECT_CLIENT_MAX_RETRIES: 0}):
        assert await mark_stale_runs_crashed("train-nope", None, db_path="x.duckdb") == 0


# --- end to end: SIGKILL `clgrpo train`, then resume it ---------------------------------------------------
FLOW_RUNS_SCRIPT = """
import asyncio, json, sys
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

async def main():
    async with get_client() as client:
        runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[sys.argv[1]])))
    print(json.dumps([{"id": str(r.id), "state": r.state.type.value, "message": r.state.message,
                       "created": r.created.isoformat()} for r in runs]))

asyncio.run(main())
"""


def isolated_prefect_env(tmp_path: Path) -> dict[str, str]:
    """Its own Prefect home (database) and no API URL: every process starts its own temporary server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120",
        PREFECT_LOGGING_LEVEL="WARNING",
        CLGRPO_STATE_DIR=str(tmp_path / "state"),
    )
    return env


@pytest.mark.integration
def test_a_sigkilled_train_leaves_no_server_and_its_rerun_marks_the_flow_run_crashed(tmp_path):
    run_id = "killed-run"
    env = isolated_prefect_env(tmp_path)
    dataset = write_jsonl(make_problems(n_per_family=2, seed=5), tmp_path / "train.jsonl")
    db = tmp_path / "kill.duckdb"
    slow = threading.Event()
    slow.set()
    policy_calls: list[float] = []

    def latency(request: ChatRequest) -> float:
        if role_of(request) == "policy":
            policy_calls.append(time.monotonic())
        return 2.0 if slow.is_set() else 0.0

    servers: list[psutil.Process] = []
    with FakeOpenAIServer(ScriptedWorld(seed=2), latency=latency) as llm:
        config = tmp_path / "run.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "run_id": run_id,
                    "dataset": {"path": str(dataset)},
                    "db_path": str(db),
                    "policy": {"model": "scripted", "base_url": llm.base_url, "api_key_env": None},
                    "grpo": {"group_size": 4, "epochs": 2, "batch_size": 8},
                    "concurrency": 8,
                }
            )
        )
        argv = [sys.executable, "-m", "application.cli", "train", "--config", str(config)]
        try:
            with open(tmp_path / "first.out", "w") as out:
                first = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
            servers = wait_for(lambda: prefect_servers(first.pid), 120, "Prefect's temporary server", first)
            assert len(servers) == 1 and prefect_server.LAUNCHER in servers[0].cmdline(), servers[0].cmdline()
            server_seen = time.monotonic()
            # mid-step: the flow (which runs once the server answers) is waiting on the slow policy
            wait_for(lambda: any(t > server_seen for t in policy_calls), 120, "the flow's first policy call", first)
            time.sleep(0.5)
            assert first.poll() is None

            first.send_signal(signal.SIGKILL)
            assert first.wait(timeout=10) == -signal.SIGKILL
            took = wait_gone(servers[0], ORPHAN_LIMIT_S)
            assert took is not None, (
                f"Prefect's server (pid {servers[0].pid}) outlived the SIGKILLed CLI by {ORPHAN_LIMIT_S:.0f} s"
            )
            print(f"the orphaned server exited {took:.2f} s after the SIGKILL")

            slow.clear()
            with open(tmp_path / "second.out", "w") as out:
                second = subprocess.run(
                    [*argv, "--run-id", run_id], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=400
                )
            output = (tmp_path / "second.out").read_text()
            assert second.returncode == 0, output[-4000:]
            assert f"run {run_id}: 2 steps" in output
        finally:
            kill_all(servers)

    listed = subprocess.run(
        [sys.executable, "-c", FLOW_RUNS_SCRIPT, f"train-{run_id}"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert listed.returncode == 0, listed.stderr[-4000:]
    runs = sorted(json.loads(listed.stdout.strip().splitlines()[-1]), key=lambda r: r["created"])
    assert len(runs) == 2, runs
    killed, resumed = runs
    assert resumed["state"] == "COMPLETED", runs
    assert killed["state"] == "CRASHED", runs
    assert "the process running it was killed" in killed["message"]
    assert f"found stale when run {run_id} was resumed" in killed["message"]
