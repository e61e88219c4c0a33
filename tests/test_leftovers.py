"""What a SIGKILLed clgrpo process leaves (owner-tagged temporary directories, marked child processes) is swept
by the next clgrpo command, and nothing of a live process ever is (``clgrpo.process.leftovers``)."""

from __future__ import annotations

import getpass
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from clgrpo.process import leftovers
from clgrpo.process.leftovers import OWNER_ENV, Owner, sweep, this_owner
from clgrpo.sandbox import isolation
from clgrpo.sandbox.isolation import isolation_problem
from clgrpo.testing.fake_openai import ChatRequest, FakeOpenAIServer, role_of
from clgrpo.testing.scripted_llm import ScriptedWorld, make_problems, write_jsonl
from tests.processes import gone
from tests.test_clean_kills import isolated_prefect_env, wait_for

ROOT = Path(__file__).resolve().parents[1]
SLEEPER = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN) if sys.argv[1:] else 0; "
    "print('up', flush=True); time.sleep(300)"
)


# --- helpers ----------------------------------------------------------------------------------------------
def dead_owner() -> Owner:
    """The owner tag of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start = int(Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    finally:
        proc.kill()
        proc.wait()
    return Owner(proc.pid, start, this_owner().pidns)


def tagged_dir(tmp: Path, owner: Owner, kind: str = "py", suffix: str = "ab12_x9z") -> Path:
    path = tmp / f"clgrpo-{kind}-{owner.tag}-{suffix}"
    path.mkdir()
    (path / "cell_output.txt").write_text("x")
    return path


def marked_sleeper(owner: Owner, ignore_term: bool = False) -> subprocess.Popen:
    env = {**os.environ, OWNER_ENV: owner.tag}
    proc = subprocess.Popen(
        [sys.executable, "-c", SLEEPER, *(["ignore"] if ignore_term else [])],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "up"  # its handler is installed
    return proc


def marked_processes(tag: str) -> list[psutil.Process]:
    """Running processes (any user: sandbox interpreters run as nobody) whose environment names ``tag``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(OWNER_ENV) == tag and not gone(proc):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:90]}"
    except psutil.Error:
        return f"{proc.pid} (gone)"


# --- owners and directories -------------------------------------------------------------------------------
def test_the_owner_tag_names_this_process_and_its_start_time():
    me = this_owner()
    assert me is not None and me.pid == os.getpid()
    assert Owner.parse(me.tag) == me and Owner.parse("12-x-3") is None and Owner.parse("1-2") is None
    assert psutil.Process().create_time() == pytest.approx(
        psutil.boot_time() + me.start / os.sysconf("SC_CLK_TCK"), abs=0.05
    )
    assert (
        tempfile.mkdtemp(prefix=leftovers.temp_prefix("py"), dir=tempfile.mkdtemp())
        .split("/")[-1]
        .startswith(f"clgrpo-py-{me.tag}-")
    )
    assert leftovers.SANDBOX_UID == isolation.NOBODY


def test_a_live_owners_directories_are_never_swept_and_a_dead_ones_are(tmp_path):
    me = this_owner()
    live = tagged_dir(tmp_path, me)
    live_build = tagged_dir(tmp_path, me, kind="llama-build")
    recycled = tagged_dir(tmp_path, Owner(me.pid, me.start + 1, me.pidns))  # this pid, another start time
    dead = tagged_dir(tmp_path, dead_owner(), kind="fetch")
    swept = sweep(str(tmp_path))
    assert live.is_dir() and live_build.is_dir()
    assert not recycled.exists() and not dead.exists()
    assert swept.dirs == {"py": 1, "fetch": 1} and swept.processes == 0 and swept.failed == []
    assert set(swept.owners) == {me.pid, Owner.parse(dead.name.split("-", 2)[2].rsplit("-", 1)[0]).pid}


def test_what_the_sweep_cannot_judge_is_left_alone(tmp_path):
    gone_owner = dead_owner()
    old_format = tmp_path / "clgrpo-py-k2j4_x8q"  # no owner: an earlier version, maybe still running
    old_format.mkdir()
    other_namespace = tagged_dir(tmp_path, Owner(gone_owner.pid, gone_owner.start, gone_owner.pidns + 1))
    unknown_kind = tagged_dir(tmp_path, gone_owner, kind="prefect")
    target = tmp_path / "not-ours"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    link = tmp_path / f"clgrpo-py-{gone_owner.tag}-link0000"
    link.symlink_to(target, target_is_directory=True)
    a_file = tmp_path / f"clgrpo-py-{gone_owner.tag}-file0000"
    a_file.write_text("")
    swept = sweep(str(tmp_path))
    assert swept.line() is None
    for path in (old_format, other_namespace, unknown_kind, link, a_file, target / "keep.txt"):
        assert path.exists(), path


@pytest.mark.skipif(os.geteuid() != 0, reason="only root's sandbox hands its directories to uid nobody")
def test_a_directory_the_sandbox_uid_owns_and_locked_is_removed(tmp_path):
    path = tagged_dir(tmp_path, dead_owner())
    locked = path / "locked"
    locked.mkdir()
    (locked / "f").write_text("y")
    for p in (path, locked, locked / "f", path / "cell_output.txt"):
        os.chown(p, isolation.NOBODY, isolation.NOBODY)
    locked.chmod(0)
    assert sweep(str(tmp_path)).dirs == {"py": 1} and not path.exists()


# --- processes --------------------------------------------------------------------------------------------
def test_a_dead_owners_processes_are_killed_and_a_live_owners_are_not(tmp_path):
    dead = dead_owner()
    stubborn = marked_sleeper(dead, ignore_term=True)  # needs the SIGKILL after the grace period
    polite = marked_sleeper(dead)
    alive = marked_sleeper(this_owner())
    try:
        started = time.monotonic()
        swept = sweep(str(tmp_path), grace_s=0.5)
        took = time.monotonic() - started
        assert stubborn.wait(5) == -signal.SIGKILL and polite.wait(5) == -signal.SIGTERM
        assert alive.poll() is None
        assert swept.processes == 2 and set(swept.owners) == {dead.pid} and swept.failed == []
        assert swept.line() == (
            f"swept leftovers of dead clgrpo process {dead.pid} ({swept.owners[dead.pid]}): 2 processes"
        )
        assert swept.owners[dead.pid].startswith(f"user {getpass.getuser()}, started 20")  # whose and when
        assert 0.5 <= took < 5, took  # the stubborn one got SIGKILL after the grace period
    finally:
        for proc in (stubborn, polite, alive):
            proc.kill()
            proc.wait()
            proc.stdout.close()


def test_this_process_is_spared_whatever_its_environment_says():
    dead = dead_owner()
    sleeper = marked_sleeper(dead)
    try:
        # a process that inherited a dead owner's marker and now sweeps (a child CLI of a killed run)
        child = subprocess.run(
            [sys.executable, "-c", "from clgrpo.process.leftovers import sweep; print(sweep().processes)"],
            env={**os.environ, OWNER_ENV: dead.tag, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert child.returncode == 0, child.stderr
        assert child.stdout.split()[-1] == "1" and sleeper.wait(5) == -signal.SIGTERM  # not the sweeping child
    finally:
        sleeper.kill()
        sleeper.wait()
        sleeper.stdout.close()


def test_the_cli_prints_one_line_and_a_failing_sweep_never_fails_the_command(monkeypatch, capsys):
    monkeypatch.setattr(
        leftovers,
        "sweep",
        lambda: leftovers.Swept({7: "user alice, started 2026-11-26 14:02"}, leftovers.Counter(py=18), 2),
    )
    monkeypatch.delenv(OWNER_ENV, raising=False)
    leftovers.on_command_start()
    assert capsys.readouterr().err == (
        "swept leftovers of dead clgrpo process 7 (user alice, started 2026-11-26 14:02): 18 sandbox directories, "
        "2 processes\n"
    )
    assert os.environ[OWNER_ENV] == this_owner().tag  # what this process starts from now on is its own

    def broken() -> None:
        raise PermissionError("denied")

    monkeypatch.setattr(leftovers, "sweep", broken)
    leftovers.on_command_start()
    assert capsys.readouterr().err == (
        "warning: could not sweep the leftovers of dead clgrpo processes: PermissionError: denied\n"
    )
    monkeypatch.setattr(leftovers, "sweep", lambda: leftovers.Swept())
    leftovers.on_command_start()
    assert capsys.readouterr().err == ""
    failed = leftovers.Swept(
        {7: "user alice, started 2026-11-26 14:02", 9: ""},
        leftovers.Counter(py=2, fetch=1),
        0,
        ["/tmp/clgrpo-py-x", "pid 12"],
    )
    assert failed.line() == (
        "swept leftovers of dead clgrpo processes 7 (user alice, started 2026-11-26 14:02), 9: 2 sandbox "
        "directories, 1 model download directory, 2 could not be removed (/tmp/clgrpo-py-x, pid 12)"
    )


# --- end to end: SIGKILL an agent-mode `clgrpo train`, then run another command ----------------------------
@pytest.fixture
def shared_tmp():
    """A TMPDIR uid nobody can enter (a sandbox's session directory lies in it), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="clgrpo-test-tmpdir-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def session_dirs(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("clgrpo-py-*"))


@pytest.mark.integration
@pytest.mark.skipif(isolation_problem() is not None, reason=str(isolation_problem()))
def test_a_sigkilled_agent_run_leaves_directories_the_next_command_sweeps(tmp_path, shared_tmp):
    env = {**isolated_prefect_env(tmp_path), "TMPDIR": str(shared_tmp)}
    env.pop(OWNER_ENV, None)
    dataset = write_jsonl(make_problems(n_per_family=3, seed=4)[:12], tmp_path / "train.jsonl")
    db = tmp_path / "agent.duckdb"
    release = threading.Event()

    def latency(request: ChatRequest) -> float:
        # a rollout that got its tool result waits: its session (interpreter and directory) stays open
        last = request.messages[-1]
        waiting = role_of(request) == "policy" and (
            last.get("role") == "tool" or "<tool_result" in str(last.get("content"))
        )
        return 300.0 if waiting and not release.is_set() else 0.0

    with FakeOpenAIServer(ScriptedWorld(seed=3, p_base=0.95), latency=latency) as llm:
        config = tmp_path / "run.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "run_id": "agent-killed",
                    "dataset": {"path": str(dataset)},
                    "db_path": str(db),
                    "policy": {"model": "scripted", "base_url": llm.base_url, "api_key_env": None},
                    "grpo": {"group_size": 4, "epochs": 1, "batch_size": 12},
                    "concurrency": 8,
                    "rollout": {"agent": {"max_turns": 4, "sandbox": {"pool_size": 8, "spares": 1}}},
                }
            )
        )
        argv = [sys.executable, "-m", "application.cli", "train", "--config", str(config), "--mode", "agent"]
        with open(tmp_path / "train.out", "w") as out:
            train = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: len(session_dirs(shared_tmp)) >= 6, 240, "six sandbox sessions", train)
            tag = session_dirs(shared_tmp)[0].name.split("-", 2)[2].rsplit("-", 1)[0]
            assert Owner.parse(tag).pid == train.pid
            interpreters = wait_for(
                lambda: (
                    [p for p in marked_processes(tag) if p.uids().real == isolation.NOBODY]
                    if os.geteuid() == 0
                    else marked_processes(tag)
                ),
                60,
                "interpreters",
                train,
            )
            before = {
                "dirs": len(session_dirs(shared_tmp)),
                "processes": [describe(p) for p in marked_processes(tag)],
                "interpreters": len(interpreters),
            }

            train.send_signal(signal.SIGKILL)
            assert train.wait(timeout=10) == -signal.SIGKILL
            killed = {"dirs": len(session_dirs(shared_tmp)), "processes": [describe(p) for p in marked_processes(tag)]}
            assert killed["dirs"] >= before["dirs"] >= 6  # the problem: a SIGKILL removes none of them

            started = time.monotonic()
            listed = subprocess.run(
                [sys.executable, "-m", "application.cli", "runs", "list", "--db", str(db)],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=300,
            )
            took = time.monotonic() - started
        finally:
            release.set()
            if train.poll() is None:
                train.kill()
                train.wait()
    print(
        f"before the kill {before}; right after it {killed}; `runs list` took {took:.1f} s; "
        f"its stderr: {listed.stderr.strip()!r}"
    )
    assert listed.returncode == 0, listed.stderr[-3000:]
    lines = [ln for ln in listed.stderr.splitlines() if ln.strip()]
    # under root the sandbox's directories belong to its own uid: then the line says when the run started, not whose
    assert len(lines) == 1 and re.fullmatch(
        rf"swept leftovers of dead clgrpo process {train.pid} \((user \S+, )?started 20\d\d-\d\d-\d\d \d\d:\d\d\): "
        rf"{killed['dirs']} sandbox directories",
        lines[0],
    ), lines
    assert session_dirs(shared_tmp) == []
    assert marked_processes(tag) == []
    # nothing more to sweep: the next command is silent
    again = subprocess.run(
        [sys.executable, "-m", "application.cli", "runs", "list", "--db", str(db)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0 and again.stderr.strip() == "", again.stderr[-3000:]
