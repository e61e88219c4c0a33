"""Process settings for long runs (clgrpo/process/runtime.py) and the console script's exit (application.cli.run)."""

import subprocess
import sys
import textwrap


def _python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_tune_gc_freezes_what_the_imports_left_and_collects_young_objects_less_often():
    done = _python(
        """
        import gc
        from clgrpo.process.runtime import tune_gc, YOUNG_THRESHOLD
        before = gc.get_freeze_count()
        tune_gc(); tune_gc()  # once per process
        print(before, gc.get_freeze_count() > 1000, gc.get_threshold()[0] == YOUNG_THRESHOLD)
    """,
        {"CLGRPO_TUNE_GC": "1"},
    )
    assert done.stdout.split() == ["0", "True", "True"], done.stderr


def test_tune_gc_can_be_switched_off():
    done = _python(
        """
        import gc
        from clgrpo.process.runtime import tune_gc
        tune_gc()
        print(gc.get_freeze_count(), gc.get_threshold()[0])
    """,
        {"CLGRPO_TUNE_GC": "0"},
    )
    assert done.stdout.split() == ["0", "700"], done.stderr


def test_the_console_script_exits_with_the_command_code_after_threads_and_exit_handlers():
    """``clgrpo`` skips the interpreter's teardown, not the exit work: a running thread finishes, atexit
    handlers run (in order), output is flushed, and the exit code is the command's."""
    done = _python("""
        import atexit, sys, threading, time
        from application import cli
        atexit.register(lambda: print("second handler", flush=True))
        atexit.register(lambda: print("first handler", end="\\n"))
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
        sys.argv = ["clgrpo", "runs", "list", "--db", "/nonexistent/dir/runs.duckdb"]
        print("buffered line", end="")
        cli.run()
        print("never")
    """)
    assert done.returncode == 2, done.stderr
    assert done.stdout.splitlines() == ["buffered linethread done", "first handler", "second handler"]
    assert done.stderr.startswith("error: ") and len(done.stderr.strip().splitlines()) == 1
