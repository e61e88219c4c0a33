"""Acceptance: lesson-by-lesson review in the Prefect UI. A real `prefect server` (with its UI and its scheduler
service), a process worker, the refresh flow deployed with a schedule and `review: required` on a production
traces file; the run the scheduler creates trains on the traces against the scripted model, passes the gate
and suspends with the review form; headless Chromium
opens the paused run, approves one change, edits one, rejects the rest and submits; the worker resumes the run
to completion; the served library has exactly those changes, the decisions and the backup are stored, and
`clgrpo library rollback` puts the previous library back. Screenshots of the review go to the test's temporary
folder, or to $CLGRPO_SCREENSHOT_DIR (`CLGRPO_SCREENSHOT_DIR=docs/images` refreshes the README's)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from application.cli import main
from clgrpo.experience.library import ExperienceLibrary
from clgrpo.storage.store import Store
from clgrpo.testing.fake_openai import FakeOpenAIServer
from clgrpo.testing.scripted_llm import ScriptedWorld, make_problems
from tests.processes import SERVER_ENV, free_port, start_detached, stop_group, wait_healthy
from tests.test_refresh_flow import refresh_config
from tests.test_refresh_traces import land, traces_of

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
EDITED = "Write down every known quantity with its unit before computing."

try:
    import playwright.sync_api  # noqa: F401

    HAVE_PLAYWRIGHT = True
except ImportError:
    HAVE_PLAYWRIGHT = False

pytestmark = [
    pytest.mark.integration,
    pytest.mark.long,  # 100 s or more (a browser, a real server's scheduler, a worker): -m long runs it
    pytest.mark.skipif(not HAVE_PLAYWRIGHT, reason="playwright is not installed (pip install -e '.[dev]')"),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} is missing (apt-get install chromium)"),
]

DEPLOY = """
import json, sys
from prefect import flow
from datetime import datetime, timedelta
from prefect.schedules import Interval
params = json.loads(sys.argv[1])
first = datetime.fromisoformat(sys.argv[3])  # the first scheduled run: soon, so the test sees the scheduler's run
flow.from_source(source=sys.argv[2], entrypoint="flows/refresh.py:refresh").deploy(
    name="nightly-review", work_pool_name="review-cpu",
    schedules=[Interval(timedelta(days=1), anchor_date=first, timezone="UTC")],
    parameters=params, print_next_steps=False)
"""
SCHEDULER_ENV = {"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5"}  # the scheduler looks every 5 s


def _prefect(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "prefect", *args], env=env, cwd=ROOT, text=True, capture_output=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


async def _flow_run(api_url: str, flow_run_id: str):
    from prefect.client.orchestration import PrefectClient

    async with PrefectClient(api_url) as client:
        return await client.read_flow_run(flow_run_id)


def _wait_state(api_url: str, flow_run_id: str, done: callable, logs: Path, timeout: float = 400):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = asyncio.run(_flow_run(api_url, flow_run_id))
        if done(run.state):
            return run
        if run.state.is_final():
            break
        time.sleep(2)
    tail = "\n".join(p.read_text()[-4000:] for p in sorted(logs.glob("*.log")))
    raise AssertionError(f"flow run {flow_run_id} is {run.state.type}: {run.state.message}\n{tail}")


@pytest.fixture
def ui_stack(tmp_path):
    """A Prefect server with its UI and one process worker on pool review-cpu; yields (env, ui_url, home)."""
    home = tmp_path / "prefect-home"
    home.mkdir()
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    base.update(
        PREFECT_HOME=str(home), DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONPATH=str(ROOT)
    )
    env = {**base, "PREFECT_API_URL": api_url, "PREFECT_WORKER_QUERY_SECONDS": "1"}
    procs = []
    try:
        procs.append(
            start_detached(
                [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                {**base, **SCHEDULER_ENV, **SERVER_ENV, "PREFECT_UI_API_URL": api_url},
                home / "server.log",
                ROOT,
            )
        )
        wait_healthy(api_url, procs[0], home / "server.log")
        _prefect(env, "work-pool", "create", "review-cpu", "--type", "process")
        procs.append(
            start_detached(
                [sys.executable, "-m", "prefect", "worker", "start", "--pool", "review-cpu", "--name", "review-worker"],
                env,
                home / "worker.log",
                ROOT,
            )
        )
        yield env, f"http://127.0.0.1:{port}", home
    finally:
        for proc in reversed(procs):
            stop_group(proc)


async def _runs_of_deployment(api_url: str) -> list:
    from prefect.client.orchestration import PrefectClient

    async with PrefectClient(api_url) as client:
        deployment = await client.read_deployment_by_name("refresh/nightly-review")
        from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

        return await client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
        )


def _scheduled_run(api_url: str, first: datetime, logs: Path, timeout: float = 180) -> str:
    """The flow run the server's scheduler created for the schedule's first time (no `deployment run` here)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = [
            r
            for r in asyncio.run(_runs_of_deployment(api_url))
            if r.expected_start_time and abs((r.expected_start_time - first).total_seconds()) < 1
        ]
        if runs:
            assert runs[0].auto_scheduled, "the run was not created by the scheduler"
            return str(runs[0].id)
        time.sleep(2)
    raise AssertionError(f"the scheduler created no run for {first}: {(logs / 'server.log').read_text()[-3000:]}")


def _screenshot(page, name: str, folder: Path) -> None:
    folder = Path(os.environ.get("CLGRPO_SCREENSHOT_DIR") or folder)
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / name), full_page=True)


def _choose(page, dialog, index: int, choice: str) -> None:
    """The index-th Decision select of the form (a Prefect UI select: a button that opens a list of options);
    every text field of the form is a textarea."""
    dialog.locator("button.p-select-button__control").nth(index).click()  # focuses it (a click alone
    page.keyboard.press("ArrowDown")  # does not open the list headless; the arrow key does)
    page.get_by_role("option", name=choice, exact=True).click()


def review_in_browser(
    ui_url: str, flow_run_id: str, refresh_id: str, answers: list[tuple[str, str, str]], dump: Path
) -> None:
    """Open the paused run, press Resume and answer each change in form order: (decision, text for edit,
    reason); name the reviewer; submit. Screenshots: the artifact listing the changes, the empty and the
    filled form."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(f"{ui_url}/artifacts/key/nightly-review", wait_until="networkidle")
            page.locator("a[href*='/artifacts/artifact/']").first.click()
            page.get_by_text(f"Review {refresh_id}").first.wait_for()
            _screenshot(page, "review-artifact.png", dump.parent)
            page.goto(f"{ui_url}/runs/flow-run/{flow_run_id}", wait_until="networkidle")
            page.get_by_role("button", name="Resume").first.click()
            dialog = page.get_by_role("dialog")
            dialog.get_by_text("c1: ").first.wait_for()
            _screenshot(page, "review-form.png", dump.parent)
            texts = dialog.locator("textarea")
            for i, (decision, text, reason) in enumerate(answers):
                _choose(page, dialog, i, decision)
                if text:
                    texts.nth(2 * i).fill(text)
                texts.nth(2 * i + 1).fill(reason)
            texts.last.fill("ana")  # the reviewer: the form's last field
            dialog.get_by_text("c1: ").first.scroll_into_view_if_needed()
            _screenshot(page, "review-filled.png", dump.parent)
            dialog.get_by_role("button", name="Submit").click()
            dialog.wait_for(state="hidden")
        except Exception:
            dump.write_text(page.content())
            page.screenshot(path=str(dump.with_suffix(".png")), full_page=True)
            raise
        finally:
            browser.close()


def test_review_in_the_prefect_ui_then_rollback(ui_stack, tmp_path):
    env, ui_url, home = ui_stack
    now = datetime.now(timezone.utc)
    with FakeOpenAIServer(ScriptedWorld(seed=11)) as server:
        config = refresh_config(server, tmp_path, review="required", review_timeout_s=3600)
        config = config.model_copy(update={"source": config.source.model_copy(update={"kind": "traces"})})
        land(
            tmp_path / "incoming" / "traces.jsonl",
            traces_of(make_problems(n_per_family=3, seed=5), now - timedelta(hours=3)),
            now - timedelta(hours=1),
        )
        params = {"config": config.model_dump(mode="json")}  # no as_of: the refresh takes its scheduled start
        first = now + timedelta(seconds=40)
        deployed = subprocess.run(
            [sys.executable, "-c", DEPLOY, json.dumps(params), str(ROOT), first.isoformat()],
            env=env,
            cwd=ROOT,
            text=True,
            capture_output=True,
            timeout=180,
        )
        assert deployed.returncode == 0, deployed.stdout + deployed.stderr
        flow_run_id = _scheduled_run(env["PREFECT_API_URL"], first, home)
        _wait_state(env["PREFECT_API_URL"], flow_run_id, lambda s: s.is_paused(), home)
        db = config.training.db_path
        with Store(db, read_only=True) as store:
            request = store.review_requests("nightly")[0]
            taken = store.records("refresh_inputs", request.refresh_id)
        assert request.flow_run_id == flow_run_id and len(request.changes) >= 3
        assert request.refresh_id == f"nightly-{first:%Y-%m-%d}" and len(taken) == 12  # the traces, all of them
        changes = request.changes
        answers = [
            ("approve", "", "clear and general"),
            ("edit", EDITED, "say what to write down"),
            *[("reject", "", "too narrow") for _ in changes[2:]],
        ]
        review_in_browser(ui_url, flow_run_id, request.refresh_id, answers, tmp_path / "form.html")
        run = _wait_state(env["PREFECT_API_URL"], flow_run_id, lambda s: s.is_final(), home)
        assert run.state.is_completed(), run.state.message

    with Store(db, read_only=True) as store:
        rows = store.records("review_decisions", request.refresh_id)
        decision = store.refresh_decisions("nightly")[0]
        history = store.library_adoptions("nightly")
    assert [(r.change_id, r.decision, r.reviewer) for r in rows] == [
        (c.change_id, a[0], "ana") for c, a in zip(changes, answers)
    ]
    assert rows[1].after == EDITED and rows[0].reason == "clear and general"
    expected = {}  # the baseline was empty: exactly the approved and the edited change
    for change, text in ((changes[0], changes[0].proposed), (changes[1], EDITED)):
        assert change.op == "add"
        expected[change.exp_id] = text
    served = tmp_path / "refresh" / "nightly" / "promoted.json"
    assert ExperienceLibrary.load(served).as_dict() == expected
    assert decision.status == "promoted" and "review by ana: 2 of" in decision.reasons[-1]
    # the library the review left (one change approved, one edited, the rest rejected) was measured itself
    assert decision.eval_id == f"{request.refresh_id}-served" and "passed the gate" in decision.reasons[-1]
    assert [(a.action, a.version, a.actor) for a in history] == [("promote", 1, "ana")]
    backup = tmp_path / "refresh" / "nightly" / "backups" / "promoted.v1.seed.json"
    assert ExperienceLibrary.load(backup).as_dict() == expected
    # nothing earlier to roll back to: refused; then a rollback after a second promotion
    assert main(["library", "rollback", "nightly", "--db", db]) == 2
    with Store(db) as store:
        from clgrpo.refresh import adopt

        second = ExperienceLibrary.load(backup).as_dict() | {"E99": "Check the answer by estimation."}
        library = ExperienceLibrary.from_mapping(second)
        store.save_library("manual", library)
        adopt.adopt(store, "nightly", served.parent, library, "manual:0", "manual", actor="test")
    assert ExperienceLibrary.load(served).as_dict() == second
    assert main(["library", "rollback", "nightly", "--actor", "bob", "--db", db]) == 0
    assert ExperienceLibrary.load(served).as_dict() == expected
