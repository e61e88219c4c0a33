"""``clgrpo.process.stopping`` in real subprocesses: a stop signal cancels the registered coroutine; a coroutine that
swallows the cancellation gets it again; a second signal, or a shutdown past the grace period, exits at once
with one line; outside an event loop the signal raises ``Stopped``. (The CLI and flows: tests/test_stop_signals.py.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = textwrap.dedent("""
    import asyncio, sys
    from clgrpo.process import stopping

    stopping.install_handlers()
    stopping.set_resume_hint("clgrpo train --run-id r")
    mode = sys.argv[1]

    async def work():
        stopping.note_stage("step 3 rollout")
        print("ready", flush=True)
        swallowed = 0
        while True:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                if mode == "cooperative":
                    raise
                swallowed += 1
                print(f"swallowed {swallowed}", flush=True)
                if mode == "swallow-once" and swallowed == 1:
                    continue
                if mode == "hang":
                    await asyncio.sleep(30)  # a shutdown that never ends

    try:
        if mode == "no-loop":
            print("ready", flush=True)
            import time
            time.sleep(30)
        else:
            stopping.run_command(work())
    except stopping.Stopped as exc:
        print(f"error: {stopping.stop_line(exc.signum)}", file=sys.stderr)
        sys.exit(stopping.exit_code(exc.signum))
""")


def start(mode: str, tmp_path: Path, grace_s: float = 8.0) -> subprocess.Popen:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    proc = subprocess.Popen(
        [sys.executable, str(script), mode],
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={"PYTHONPATH": str(ROOT), "CLGRPO_STOP_GRACE_S": str(grace_s), "PATH": "/usr/bin:/bin"},
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def finish(proc: subprocess.Popen) -> tuple[int, str, str, float]:
    began = time.monotonic()
    out, err = proc.communicate(timeout=30)
    return proc.returncode, out, err, time.monotonic() - began


def test_a_signal_cancels_the_running_coroutine_and_names_the_stage(tmp_path):
    proc = start("cooperative", tmp_path)
    proc.send_signal(signal.SIGTERM)
    rc, _, err, took = finish(proc)
    assert rc == 143 and took < 5
    assert err.strip() == (
        "error: terminated (SIGTERM) during step 3 rollout: finished work is stored; "
        "resume with: clgrpo train --run-id r"
    )


def test_a_swallowed_cancellation_is_sent_again(tmp_path):
    proc = start("swallow-once", tmp_path)
    proc.send_signal(signal.SIGHUP)
    rc, out, err, _ = finish(proc)
    assert "swallowed 1" in out and "swallowed 2" in out
    assert rc == 129 and err.count("error:") == 1 and "terminated (SIGHUP)" in err


def test_a_second_signal_exits_at_once_with_one_line(tmp_path):
    proc = start("hang", tmp_path)
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().strip() == "swallowed 1"
    proc.send_signal(signal.SIGINT)
    rc, _, err, took = finish(proc)
    assert rc == 130 and took < 5
    assert err.count("\n") == 1 and err.startswith("error: terminated (SIGINT) during step 3 rollout; a second signal")
    assert "Traceback" not in err


def test_a_shutdown_past_the_grace_period_exits(tmp_path):
    proc = start("hang", tmp_path, grace_s=1.0)
    proc.send_signal(signal.SIGTERM)
    rc, _, err, took = finish(proc)
    assert rc == 143 and took < 6
    assert "shutdown took longer than 1 s: exiting now" in err and err.count("error:") == 1


def test_outside_an_event_loop_the_signal_raises_stopped(tmp_path):
    proc = start("no-loop", tmp_path)
    proc.send_signal(signal.SIGTERM)
    rc, _, err, took = finish(proc)
    assert rc == 143 and took < 5 and err.startswith("error: terminated (SIGTERM)") and "Traceback" not in err
