"""Integration: a real `prefect server`, `cpu` and `cuda` process pools with one worker each, `prefect deploy
--all`, and `prefect deployment run` of the training flow with rollouts routed to the cuda pool, then a forced
failure retried through the API. The server's own scheduler service (its loop shortened to a few seconds) must
create the runs of scheduled deployments: the nightly refresh's upcoming 02:00 UTC runs, and the runs of an
interval deployment, one of which the cpu worker executes end to end. Every process started here is stopped
by pid."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING
from uuid import UUID

import pytest

from clgrpo.storage.store import Store
from clgrpo.testing.fake_openai import FakeOpenAIServer, Fault, role_of
from clgrpo.testing.scripted_llm import ScriptedWorld, make_problems, write_jsonl
from tests.processes import SERVER_ENV, free_port, start_detached, stop_group, wait_healthy
from tests.test_refresh_flow import NIGHT, arrive, refresh_config

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.integration
# the server's scheduler service visits every deployment with an active schedule this often (default 60 s)
SCHEDULER_ENV = {"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5"}


@dataclass
class Stack:
    env: dict[str, str]
    api_url: str
    logs: Path

    def prefect(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "prefect", *args],
            env=self.env,
            cwd=ROOT,
            text=True,
            capture_output=True,
            timeout=timeout,
        )


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    base.update(
        PREFECT_HOME=str(home),
        DO_NOT_TRACK="1",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PYTHONPATH=str(ROOT),  # the scripts call `prefect`: this interpreter's, activated or not
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    )
    env = {
        **base,
        "PREFECT_API_URL": api_url,
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_WORKER_PREFETCH_SECONDS": "5",
        "CLGRPO_PROJECT_DIR": str(ROOT),
    }
    env.pop("CUDA_VISIBLE_DEVICES", None)
    procs: list[subprocess.Popen] = []
    try:
        server_log = home / "server.log"
        procs.append(
            start_detached(
                [
                    sys.executable,
                    "-m",
                    "prefect",
                    "server",
                    "start",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--no-ui",
                ],
                {**base, **SCHEDULER_ENV, **SERVER_ENV},
                server_log,
                ROOT,
            )
        )
        wait_healthy(api_url, procs[0], server_log)
        stack = Stack(env, api_url, home)
        created = subprocess.run(
            ["bash", "deployments/create-pools.sh"], env=env, cwd=ROOT, text=True, capture_output=True, timeout=180
        )
        assert created.returncode == 0, created.stdout + created.stderr
        for pool, name in (("cpu", "cpu-1"), ("cuda", "gpu0-stand-in")):
            procs.append(
                start_detached(
                    [
                        sys.executable,
                        "-m",
                        "prefect",
                        "worker",
                        "start",
                        "--pool",
                        pool,
                        "--name",
                        name,
                        "--limit",
                        "4",
                    ],
                    env,
                    home / f"worker-{pool}.log",
                    ROOT,
                )
            )
        deployed = subprocess.run(
            ["bash", "deployments/deploy.sh"], env=env, cwd=ROOT, text=True, capture_output=True, timeout=300
        )
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        yield stack
    finally:
        for proc in reversed(procs):
            stop_group(proc)


def _config(server: FakeOpenAIServer, tmp_path: Path, run_id: str, epochs: int) -> dict:
    dataset = write_jsonl(make_problems(n_per_family=2, seed=4), tmp_path / "train.jsonl")
    return {
        "run_id": run_id,
        "db_path": str(tmp_path / "deploy.duckdb"),
        "dataset": {"path": str(dataset)},
        "policy": {"model": "scripted", "base_url": server.base_url, "api_key_env": None, "retry_base_delay_s": 0.01},
        "grpo": {"group_size": 4, "epochs": epochs, "batch_size": 8, "rollout_chunk_size": 8},
        "concurrency": 8,
        "rollout": {"placement": "pool", "handoff_storage": str(tmp_path / "handoff"), "poll_interval_s": 1},
        "learning": {"library_gate": {"enabled": False}},  # these tests count the pools' rollouts of every problem
    }


def _run(stack: Stack, config: dict) -> subprocess.CompletedProcess:
    return stack.prefect(
        "deployment",
        "run",
        "train/train",
        "--params",
        json.dumps({"config": config}),
        "--watch",
        "--watch-interval",
        "2",
        timeout=420,
    )


async def _flow_runs(stack: Stack, flow_name: str):
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    async with PrefectClient(stack.api_url) as client:
        return await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])))


def _logs(stack: Stack) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(stack.logs.glob("worker-*.log")))


def _retry_and_wait(stack: Stack, flow_run_id, timeout: float = 240):
    """`prefect flow-run retry` (what the UI's Retry does), then wait until that attempt is final."""
    retry = stack.prefect("flow-run", "retry", str(flow_run_id), timeout=60)
    assert retry.returncode == 0, retry.stdout + retry.stderr
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = [r for r in asyncio.run(_flow_runs(stack, "train")) if r.id == flow_run_id][0]
        if run.state.is_final() and run.run_count >= 2:
            return run
        time.sleep(2)
    raise AssertionError(f"retried flow run {flow_run_id} not final after {timeout}s: {_logs(stack)}")


def test_deployment_run_routes_rollouts_to_the_cuda_pool(stack, tmp_path):
    with FakeOpenAIServer(ScriptedWorld(seed=3)) as server:
        config = _config(server, tmp_path, "deployed", epochs=2)
        run = _run(stack, config)
        assert run.returncode == 0, run.stdout + run.stderr + _logs(stack)

    with Store(config["db_path"], read_only=True) as store:
        assert store.library_versions("deployed") == [0, 1, 2]
        rollouts = store.query(
            "SELECT step, count(*) AS n FROM rollouts WHERE run_id='deployed' GROUP BY step ORDER BY step"
        )
        assert rollouts["n"].tolist() == [32, 32]
        stages = set(store.query("SELECT DISTINCT stage FROM llm_calls WHERE run_id='deployed'")["stage"])
        assert {"rollout", "summarize", "group_advantage"} <= stages
    children = asyncio.run(_flow_runs(stack, "rollout-gpu"))
    assert len(children) == 2 and all(c.work_pool_name == "cuda" and c.state.is_completed() for c in children)
    handoffs = sorted((tmp_path / "handoff" / "deployed").glob("*.json"))
    assert len(handoffs) == 2
    assert {json.loads(h.read_text())["meta"]["cuda_visible_devices"] for h in handoffs} == {"0"}


def test_failed_stage_is_retried_through_the_api_and_resumes(stack, tmp_path):
    with FakeOpenAIServer(ScriptedWorld(seed=5)) as server:
        server.inject(Fault(kind="status", status=400, times=1, match=lambda r: role_of(r) == "library consolidator"))
        config = _config(server, tmp_path, "retried", epochs=1)
        failed = _run(stack, config)
        assert failed.returncode != 0, failed.stdout
        policy_before = server.stats.by_role["policy"]
        summaries_before = server.stats.by_role["trajectory summarizer"]
        assert policy_before > 0 and server.stats.faults_served["status:400"] == 1

        runs = [r for r in asyncio.run(_flow_runs(stack, "train")) if r.name == "train-retried"]
        assert len(runs) == 1 and runs[0].state.is_failed()
        assert "HTTP 400" in (runs[0].state.message or "") or "400" in _logs(stack)
        run = _retry_and_wait(stack, runs[0].id)
        assert run.state.is_completed(), (run.state, _logs(stack))
        assert run.run_count == 2
        # completed stages were not executed again: no new rollouts, summaries or rollout children
        assert server.stats.by_role["policy"] == policy_before
        assert server.stats.by_role["trajectory summarizer"] == summaries_before
    children = [c for c in asyncio.run(_flow_runs(stack, "rollout-gpu")) if "retried" in c.name]
    assert len(children) == 1
    with Store(config["db_path"], read_only=True) as store:
        assert store.library_versions("retried") == [0, 1]
        assert len(store.load_library("retried")) > 0


@pytest.mark.long  # about 30 s or more; a shorter test of the same guarantee stays in the default run
def test_retrying_the_parent_reruns_its_failed_gpu_child_without_a_duplicate(stack, tmp_path):
    gpu_down = [True]  # every policy call fails (HTTP 400) until the "GPU" is back
    with FakeOpenAIServer(ScriptedWorld(seed=7)) as server:
        server.inject(
            Fault(kind="status", status=400, times=1_000_000, match=lambda r: gpu_down[0] and role_of(r) == "policy")
        )
        config = _config(server, tmp_path, "gpu-retried", epochs=1)
        failed = _run(stack, config)
        assert failed.returncode != 0, failed.stdout
        (parent,) = [r for r in asyncio.run(_flow_runs(stack, "train")) if r.name == "train-gpu-retried"]
        assert parent.state.is_failed() and "rollout child run" in (parent.state.message or "")
        (child,) = [c for c in asyncio.run(_flow_runs(stack, "rollout-gpu")) if "gpu-retried" in c.name]
        assert child.state.is_failed()

        gpu_down[0] = False
        run = _retry_and_wait(stack, parent.id)
        assert run.state.is_completed(), (run.state, _logs(stack))
    (rerun,) = [c for c in asyncio.run(_flow_runs(stack, "rollout-gpu")) if "gpu-retried" in c.name]
    assert rerun.id == child.id and rerun.run_count == 2 and rerun.state.is_completed()
    with Store(config["db_path"], read_only=True) as store:
        assert store.library_versions("gpu-retried") == [0, 1]
        assert store.query("SELECT count(*) AS n FROM rollouts WHERE run_id='gpu-retried'")["n"][0] == 32


@pytest.mark.long  # about 30 s or more; a shorter test of the same guarantee stays in the default run
def test_a_gpu_child_that_left_failed_samples_is_run_again_not_replayed(stack, tmp_path):
    """One of the child's 8 policy requests fails for good: 4/32 samples (12.5%) is over the rollout tolerance,
    so the parent fails; its Retry runs the completed child again instead of re-reading the failed samples."""
    with FakeOpenAIServer(ScriptedWorld(seed=9)) as server:
        server.inject(Fault(kind="status", status=400, times=1, match=lambda r: role_of(r) == "policy"))
        config = _config(server, tmp_path, "gpu-partial", epochs=1)
        failed = _run(stack, config)
        assert failed.returncode != 0, failed.stdout
        (parent,) = [r for r in asyncio.run(_flow_runs(stack, "train")) if r.name == "train-gpu-partial"]
        assert parent.state.is_failed() and "step 1 rollout: 4/32 samples failed" in (parent.state.message or "")
        requests_before = server.stats.chat_requests
        run = _retry_and_wait(stack, parent.id)
        assert run.state.is_completed(), (run.state, _logs(stack))
        requests = server.stats.chat_requests
    (child,) = [c for c in asyncio.run(_flow_runs(stack, "rollout-gpu")) if "gpu-partial" in c.name]
    assert child.run_count == 2 and child.state.is_completed()
    with Store(config["db_path"], read_only=True) as store:
        rollouts = store.records("rollouts", "gpu-partial", 1)
        policy_calls = store.query(
            "SELECT count(*) AS n FROM llm_calls WHERE run_id='gpu-partial' AND stage='rollout'"
        )["n"][0]
    assert len(rollouts) == 32 and not [r for r in rollouts if r.error]
    assert policy_calls == 8 + 8  # both children's requests are accounted, the failed one included
    assert requests > requests_before
    assert list((tmp_path / "handoff" / "gpu-partial").glob("*.had-failures"))


async def _deployment(stack: Stack, name: str):
    from prefect.client.orchestration import PrefectClient

    async with PrefectClient(stack.api_url) as client:
        return await client.read_deployment_by_name(name)


def test_nightly_refresh_is_scheduled_and_a_run_without_new_data_says_so(stack, tmp_path):
    deployment = asyncio.run(_deployment(stack, "refresh/nightly-refresh"))
    (schedule,) = deployment.schedules
    assert schedule.active and schedule.schedule.cron == "0 2 * * *" and schedule.schedule.timezone == "UTC"
    assert deployment.global_concurrency_limit is not None and deployment.global_concurrency_limit.limit == 1
    assert deployment.work_pool_name == "cpu"

    (tmp_path / "incoming").mkdir()
    heldout = write_jsonl(make_problems(n_per_family=1, seed=9), tmp_path / "heldout.jsonl")
    config = {
        "name": "deployed",
        "source": {"path": str(tmp_path / "incoming")},
        "training": {"db_path": str(tmp_path / "refresh.duckdb")},
        "evaluation": {"dataset": {"path": str(heldout)}},
    }
    run = stack.prefect(
        "deployment",
        "run",
        "refresh/nightly-refresh",
        "--params",
        json.dumps({"config": config, "as_of": "2026-11-23T02:00:00+00:00"}),
        "--watch",
        "--watch-interval",
        "2",
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr + _logs(stack)
    with Store(config["training"]["db_path"], read_only=True) as store:
        (decision,) = store.refresh_decisions("deployed")
    assert decision.refresh_id == "deployed-2026-11-23" and decision.status == "no_new_data"
    runs = asyncio.run(_flow_runs(stack, "refresh"))
    assert [r.name for r in runs if r.parameters.get("as_of")] == ["refresh-deployed-2026-11-23"]


def _server_log(stack: Stack) -> str:
    return (stack.logs / "server.log").read_text()[-3000:]


async def _deployment_runs(stack: Stack, deployment_id: UUID) -> list[FlowRun]:
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    async with PrefectClient(stack.api_url) as client:
        return await client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
        )


def _await_runs(
    stack: Stack, deployment_id: UUID, keep: Callable[[FlowRun], bool], what: str, timeout: float, at_least: int = 1
) -> list[FlowRun]:
    """The deployment's runs that ``keep`` accepts, once there are ``at_least``; fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        runs = [r for r in asyncio.run(_deployment_runs(stack, deployment_id)) if keep(r)]
        if len(runs) >= at_least:
            return runs
        if time.monotonic() > deadline:
            seen = [
                (r.name, r.state.name if r.state else None, r.auto_scheduled)
                for r in asyncio.run(_deployment_runs(stack, deployment_id))
            ]
            raise AssertionError(
                f"{len(runs)} {what} after {timeout}s (want {at_least}); runs: {seen}\n"
                f"server log:\n{_server_log(stack)}\n{_logs(stack)}"
            )
        time.sleep(2)


def test_the_scheduler_service_creates_the_upcoming_nightly_refresh_runs(stack):
    """Nobody runs `refresh/nightly-refresh` here: the server's scheduler fills it with 02:00 UTC runs."""
    deployment = asyncio.run(_deployment(stack, "refresh/nightly-refresh"))
    (schedule,) = deployment.schedules
    try:
        runs = _await_runs(
            stack,
            deployment.id,
            lambda r: r.auto_scheduled and r.state.name == "Scheduled",
            "scheduler-created Scheduled runs of refresh/nightly-refresh",
            timeout=90,
            at_least=3,
        )
    finally:  # a suite running at 02:00 UTC must not run the shipped refresh on the repository's own paths
        asyncio.run(_pause(stack, deployment.id))
    assert all(r.created_by and r.created_by.type == "SCHEDULE" and r.created_by.id == schedule.id for r in runs)
    starts = sorted(r.expected_start_time.astimezone(timezone.utc) for r in runs)
    assert starts[0] > datetime.now(timezone.utc) - timedelta(minutes=5), starts
    assert all((s.hour, s.minute, s.second) == (2, 0, 0) for s in starts), starts
    assert all(b - a == timedelta(days=1) for a, b in zip(starts, starts[1:])), starts


async def _pause(stack: Stack, deployment_id: UUID) -> None:
    from prefect.client.orchestration import PrefectClient

    async with PrefectClient(stack.api_url) as client:
        await client.pause_deployment(deployment_id)


def _deploy_every(stack: Stack, name: str, seconds: int, parameters: dict) -> UUID:
    """A second deployment of the refresh flow, on the cpu pool, with an interval schedule."""
    from prefect.flows import Flow
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: stack.api_url}):
        flow = Flow.from_source(source=str(ROOT), entrypoint="flows/refresh.py:refresh")
        return flow.deploy(
            name=name,
            work_pool_name="cpu",
            interval=seconds,
            parameters=parameters,
            concurrency_limit=1,
            print_next_steps=False,
            ignore_warnings=True,
        )


async def _retire(stack: Stack, deployment_id: UUID, timeout: float = 180) -> None:
    """Pause the deployment (the scheduler stops), cancel its runs that have not started, let the started
    ones finish, then delete it."""
    from prefect.client.orchestration import PrefectClient
    from prefect.states import Cancelled

    await _pause(stack, deployment_id)
    async with PrefectClient(stack.api_url) as client:
        deadline = time.monotonic() + timeout
        while unfinished := [r for r in await _deployment_runs(stack, deployment_id) if not r.state.is_final()]:
            assert time.monotonic() < deadline, f"runs still open after {timeout}s: {unfinished}\n{_logs(stack)}"
            for r in unfinished:
                if r.state.is_scheduled():  # Scheduled, Late, AwaitingConcurrencySlot
                    await client.set_flow_run_state(r.id, Cancelled(message="test cleanup"), force=True)
            await asyncio.sleep(2)
        await client.delete_deployment(deployment_id)


def test_the_scheduler_service_runs_an_interval_refresh_end_to_end(stack, tmp_path):
    """An interval deployment of the refresh flow: the scheduler creates its runs, the cpu worker executes
    one, and its decision (no new data) is dated by the run's scheduled start (no ``as_of``)."""
    (tmp_path / "incoming").mkdir()
    heldout = write_jsonl(make_problems(n_per_family=1, seed=11), tmp_path / "heldout.jsonl")
    config = {
        "name": "every-few-seconds",
        "source": {"path": str(tmp_path / "incoming")},
        "training": {"db_path": str(tmp_path / "scheduled.duckdb")},
        "evaluation": {"dataset": {"path": str(heldout)}},
    }
    deployment_id = _deploy_every(stack, "every-few-seconds", 10, {"config": config})
    try:
        (run, *_) = _await_runs(
            stack,
            deployment_id,
            lambda r: r.auto_scheduled and r.state.is_completed(),
            "completed scheduler-created runs of refresh/every-few-seconds",
            timeout=300,
        )
    finally:
        asyncio.run(_retire(stack, deployment_id))
    assert run.work_pool_name == "cpu" and "as_of" not in run.parameters
    date = run.expected_start_time.astimezone(timezone.utc).date().isoformat()
    with Store(config["training"]["db_path"], read_only=True) as store:
        decisions = {d.refresh_date: d for d in store.refresh_decisions("every-few-seconds")}
    assert date in decisions, (date, decisions)
    assert decisions[date].status == "no_new_data" and decisions[date].refresh_id == f"every-few-seconds-{date}"


def _wait_state(
    stack: Stack,
    flow_run_id,
    done: Callable[["FlowRun"], bool],
    what: str,
    timeout: float = 240,
    flow: str = "train",
):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = [r for r in asyncio.run(_flow_runs(stack, flow)) if r.id == flow_run_id]
        if runs and done(runs[0]):
            return runs[0]
        time.sleep(0.5)
    raise AssertionError(f"flow run {flow_run_id}: not {what} after {timeout}s: {_logs(stack)}")


def test_a_cancel_from_the_ui_ends_the_run_cancelled_and_a_rerun_resumes_without_duplicates(stack, tmp_path):
    """`prefect flow-run cancel` (what the UI's Cancel does) of a deployment run executing on the cpu worker:
    the flow run ends Cancelled (not Crashed or Failed), the run is stored as cancelled with its stage, the
    worker stays healthy (it executes the rerun), and the rerun resumes: no stored stage is redone, no row is
    duplicated."""
    # the learner's calls are held until the cancel has landed: on a loaded machine `prefect flow-run cancel`
    # may take longer to start than the rest of a fast run takes to finish
    learner_held = threading.Event()
    learner_held.set()
    latency = lambda r: 30.0 if learner_held.is_set() and role_of(r) != "policy" else 0.3  # noqa: E731
    with FakeOpenAIServer(ScriptedWorld(seed=11), latency=latency) as server:
        config = {**_config(server, tmp_path, "ui-cancelled", epochs=2), "rollout": {}}  # rollouts in the flow
        started = stack.prefect(
            "deployment", "run", "train/train", "--params", json.dumps({"config": config}), timeout=120
        )
        assert started.returncode == 0, started.stdout + started.stderr
        run_id = UUID(started.stdout.split("UUID:")[1].split()[0])
        run = _wait_state(stack, run_id, lambda r: r.state.is_running(), "running")
        deadline = time.monotonic() + 240
        while server.stats.by_role.get("trajectory summarizer", 0) == 0:  # step 1's learner stages have begun
            assert time.monotonic() < deadline, _logs(stack)
            time.sleep(0.1)
        cancel = stack.prefect("flow-run", "cancel", str(run.id), timeout=60)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        cancelled = _wait_state(stack, run.id, lambda r: r.state.is_final(), "final", timeout=120)
        learner_held.clear()
        assert cancelled.state.is_cancelled(), (cancelled.state, _logs(stack))
        with Store(config["db_path"], read_only=True) as store:
            status = store.runs().set_index("run_id").loc["ui-cancelled"]
            stored_before = store.query("SELECT step, stage FROM stage_runs WHERE run_id='ui-cancelled'")
        assert status["status"] == "cancelled" and "terminated (SIGTERM) during step 1" in status["error"], status
        policy_before = server.stats.by_role["policy"]

        rerun = _run(stack, config)  # the same parameters again: the same run id resumes
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr + _logs(stack)
    with Store(config["db_path"], read_only=True) as store:
        assert store.library_versions("ui-cancelled") == [0, 1, 2]
        assert store.runs().set_index("run_id").loc["ui-cancelled", "status"] == "completed"
        for table, key in (
            ("rollouts", "step, problem_id, sample_idx"),
            ("stage_runs", "step, stage"),
            ("llm_calls", "call_id, retries"),
            ("operations", "step, seq"),
        ):
            extra = store.query(
                f"SELECT count(*) - count(DISTINCT ({key})) AS n FROM {table} WHERE run_id = 'ui-cancelled'"
            )["n"][0]
            assert extra == 0, f"{table}: {extra} duplicated rows"
        step1_rollouts = store.query("SELECT count(*) AS n FROM rollouts WHERE run_id='ui-cancelled' AND step=1")
    assert step1_rollouts["n"][0] == 32
    if ((stored_before.step == 1) & (stored_before.stage == "rollout")).any():  # stored: never sampled again
        assert server.stats.by_role["policy"] - policy_before == 32 // 4  # only step 2's 8 requests


@pytest.mark.long  # about 30 s or more; a shorter test of the same guarantee stays in the default run
def test_cancelling_a_parent_cancels_its_gpu_child_and_the_rerun_starts_a_new_one(stack, tmp_path):
    """The parent of a pool run is cancelled while its rollout child samples on the cuda worker: the child is
    cancelled too (no GPU left busy for a stopped run); the parent's rerun starts a new child run for the chunk."""
    slow_policy = lambda r: 3.0 if role_of(r) == "policy" else 0.05  # noqa: E731 - the child runs a while
    with FakeOpenAIServer(ScriptedWorld(seed=13), latency=slow_policy) as server:
        config = _config(server, tmp_path, "parent-cancelled", epochs=1)
        started = stack.prefect(
            "deployment", "run", "train/train", "--params", json.dumps({"config": config}), timeout=120
        )
        assert started.returncode == 0, started.stdout + started.stderr
        parent_id = UUID(started.stdout.split("UUID:")[1].split()[0])
        deadline = time.monotonic() + 240
        while not [
            c
            for c in asyncio.run(_flow_runs(stack, "rollout-gpu"))
            if "parent-cancelled" in c.name and c.state.is_running()
        ]:
            assert time.monotonic() < deadline, _logs(stack)
            time.sleep(0.3)
        cancel = stack.prefect("flow-run", "cancel", str(parent_id), timeout=60)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        parent = _wait_state(stack, parent_id, lambda r: r.state.is_final(), "final", timeout=120)
        assert parent.state.is_cancelled(), (parent.state, _logs(stack))
        deadline = time.monotonic() + 120
        while True:
            (child,) = [c for c in asyncio.run(_flow_runs(stack, "rollout-gpu")) if "parent-cancelled" in c.name]
            if child.state.is_final() or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert child.state.is_cancelled(), (child.state, _logs(stack))

        rerun = _run(stack, config)
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr + _logs(stack)
    children = [c for c in asyncio.run(_flow_runs(stack, "rollout-gpu")) if "parent-cancelled" in c.name]
    again = [c for c in children if c.id != child.id]
    assert len(children) == 2 and len(again) == 1 and again[0].state.is_completed()  # a new child for the chunk
    with Store(config["db_path"], read_only=True) as store:
        assert store.library_versions("parent-cancelled") == [0, 1]
        assert store.query("SELECT count(*) AS n FROM rollouts WHERE run_id='parent-cancelled'")["n"][0] == 32


@pytest.mark.long  # about 30 s or more; a shorter test of the same guarantee stays in the default run
def test_hybrid_numeric_update_runs_as_its_own_child_on_the_cuda_pool(stack, tmp_path):
    pytest.importorskip("peft", reason="the local extra (torch, transformers, peft) is not installed")
    from schemas.config import RunConfig
    from tests.stored_steps import seed_first_step
    from tests.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny-model")
    with FakeOpenAIServer(ScriptedWorld(seed=5)) as server:
        config = _config(server, tmp_path, "hybrid-pool", epochs=1)
        config.update(
            learner=config["policy"],
            rollout={"placement": "local"},
            policy={
                "backend": "transformers",
                "model": "tiny",
                "model_path": str(model),
                "device": "cpu",
                "cpu_threads": 1,
                "max_tokens": 6,
            },
            grpo={"group_size": 4, "epochs": 1, "batch_size": 2, "max_steps": 1},
            hybrid={
                "enabled": True,
                "rank": 4,
                "lr": 0.02,
                "placement": "pool",
                "handoff_storage": str(tmp_path / "handoff"),
                "poll_interval_s": 1,
            },
        )
        seed_first_step(RunConfig.model_validate(config))  # groups with variance for the numeric step
        run = _run(stack, config)
        assert run.returncode == 0, run.stdout + run.stderr + _logs(stack)

    with Store(config["db_path"], read_only=True) as store:
        (adapter,) = store.records("adapters", "hybrid-pool")
    assert adapter.rows_used == 8 and adapter.device == "cpu"
    assert adapter.logprob_change_pos > 0 > adapter.logprob_change_neg
    local = tmp_path / "hybrid-pool" / "adapter_step1"
    assert Path(adapter.path) == local and (local / "adapter_model.safetensors").is_file()
    (child,) = asyncio.run(_flow_runs(stack, "numeric-update-gpu"))
    assert child.work_pool_name == "cuda" and child.state.is_completed()
    (record,) = (tmp_path / "handoff" / "hybrid-pool").glob("numeric-step0001-*/record.json")
    assert json.loads(record.read_text())["meta"]["cuda_visible_devices"] == "0"
    assert "numeric_update on cpu: no CUDA device" in (stack.logs / "worker-cuda.log").read_text()


async def _run_logs(stack: Stack, flow_run_id) -> list:
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    async with PrefectClient(stack.api_url) as client:
        return await client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))


def test_retry_of_a_review_that_timed_out_records_the_timeout_and_releases_the_problems(stack, tmp_path):
    """A reviewed refresh deployment run suspends (logged at INFO, not ERROR), nobody answers, the server fails it
    at the deadline; `refresh history` (no --db, another directory) says the review timed out, not that it is
    awaited; Retry (`prefect flow-run retry`, what the UI's button does) ends Completed with the timeout recorded:
    nothing promoted, the night's problems given back to the next refresh. It used to re-suspend on the used key
    and crash on a ValidationError."""
    with FakeOpenAIServer(ScriptedWorld(seed=11)) as server:
        config = refresh_config(server, tmp_path, review="required", review_timeout_s=60, name="unanswered")
        arrive(tmp_path / "incoming" / "day2.jsonl", make_problems(n_per_family=3, seed=5), NIGHT - timedelta(hours=12))
        params = {"config": config.model_dump(mode="json"), "as_of": NIGHT.isoformat()}
        started = stack.prefect(
            "deployment", "run", "refresh/nightly-refresh", "--params", json.dumps(params), timeout=120
        )
        assert started.returncode == 0, started.stdout + started.stderr
        run_id = UUID(started.stdout.split("UUID:")[1].split()[0])
        run = _wait_state(stack, run_id, lambda r: r.state.is_paused(), "suspended", timeout=300, flow="refresh")
        assert run.state.name == "Suspended", run.state
        errors = [log.message for log in asyncio.run(_run_logs(stack, run_id)) if log.level >= 40]
        assert errors == [], errors
        failed = _wait_state(stack, run_id, lambda r: r.state.is_final(), "failed at its deadline", 180, "refresh")
        assert failed.state.is_failed(), failed.state

    other = tmp_path / "elsewhere"
    other.mkdir()
    history = subprocess.run(
        [sys.executable, "-m", "application.cli", "refresh", "history", "--name", "unanswered"],
        env=stack.env, cwd=other, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert history.returncode == 0, history.stderr
    assert "timed out unanswered at" in history.stdout and "awaiting review" not in history.stdout, history.stdout

    retry = stack.prefect("flow-run", "retry", str(run_id), timeout=60)
    assert retry.returncode == 0, retry.stdout + retry.stderr
    retried = _wait_state(
        stack, run_id, lambda r: r.state.is_final() and r.run_count >= 2, "final after Retry", 240, "refresh"
    )
    assert retried.state.is_completed(), (retried.state, _logs(stack))
    with Store(config.training.db_path, read_only=True) as store:
        (decision,) = store.refresh_decisions("unanswered")
        assert store.consumed_problem_keys("unanswered") == set()
        assert store.library_adoptions("unanswered") == []
    assert decision.status == "not_promoted" and decision.released
    assert "review timed out after 60 s" in " ".join(decision.reasons), decision.reasons
    history = subprocess.run(
        [sys.executable, "-m", "application.cli", "refresh", "history", "--name", "unanswered"],
        env=stack.env, cwd=other, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "unanswered-2026-11-21: not_promoted" in history.stdout, history.stdout
