"""The ``clgrpo`` command line: train, library show|diff|export|ops|rollback, runs list|show|delete, model
fetch|path|list|build-server|serve, data make, web-world, demo, eval, report, refresh run|history, review. Each
command is a module of ``application.commands``; this module builds the parser from them and runs one.

Every user error ends a command with one ``error:`` line (what is wrong: file, row and field, URL, environment
variable, model) and a non-zero exit; commands that run flows keep the full log, tracebacks included, in a log
file next to their DuckDB file (``logs/``), and Prefect keeps it for the UI.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import threading
from collections.abc import Sequence

from application.commands.common import Command, CommandGroup
from application.commands.data import DATA
from application.commands.demo import DEMO
from application.commands.eval import EVAL
from application.commands.library import LIBRARY
from application.commands.model import MODEL
from application.commands.refresh import REFRESH
from application.commands.report import REPORT
from application.commands.review import REVIEW
from application.commands.runs import RUNS
from application.commands.train import TRAIN
from application.commands.web_world import WEB_WORLD
from clgrpo.experience.library import LibraryFormatError
from clgrpo.inputs.config import ConfigError
from clgrpo.inputs.leakage import LeakageError
from clgrpo.models.weights import ModelError
from clgrpo.process import leftovers, stopping
from clgrpo.process.errors import error_line
from clgrpo.storage.connection import StoreError
from tasks.preflight import PreflightError

# the commands, in the order `clgrpo --help` lists them
COMMANDS: tuple[Command | CommandGroup, ...] = (
    TRAIN,
    LIBRARY,
    RUNS,
    MODEL,
    DATA,
    WEB_WORLD,
    DEMO,
    EVAL,
    REPORT,
    REFRESH,
    REVIEW,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clgrpo", description="Continuous Learning GRPO: learn an experience library")
    parser.add_argument("--version", action="version", version=f"clgrpo {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return parser


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("clgrpo")
    except PackageNotFoundError:  # running from a checkout that is not installed
        return "unknown"


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean the input is wrong (exit 2), as opposed to a run that failed (exit 1)."""
    from clgrpo.inputs.dataset import DatasetError
    from clgrpo.llm.adapters import AdapterError
    from clgrpo.process.errors import EvaluationError
    from clgrpo.refresh.review import ReviewError
    from clgrpo.refresh.sources import SourceError

    return (
        ConfigError,
        StoreError,
        LibraryFormatError,
        ModelError,
        LeakageError,
        PreflightError,
        DatasetError,
        SourceError,
        EvaluationError,
        ReviewError,
        AdapterError,
    )


def worded_errors() -> tuple[type[BaseException], ...]:
    """Failures whose message is written for the user as it is (no exception type in front), exit 1: the local
    engine could not be built, trusted or kept running."""
    from application.llama_build import BuildError
    from application.llama_server import ServerError

    return (ServerError, BuildError)


def main(argv: Sequence[str] | None = None) -> int:
    stopping.install_handlers()  # SIGTERM, SIGINT and SIGHUP end every command the same way
    args = build_parser().parse_args(argv)
    leftovers.on_command_start()  # sweep what killed clgrpo processes left; mark this one's children
    from application.terminal import last_log

    try:
        code = args.func(args)
        if (signum := stopping.requested()) is not None:  # it came as the work ended: still say so
            print(f"error: {stopping.stop_line(signum)}", file=sys.stderr)
            return stopping.exit_code(signum)
        return code
    except (stopping.Stopped, KeyboardInterrupt) as exc:
        signum = exc.signum if isinstance(exc, stopping.Stopped) else stopping.requested() or 2
        print(f"error: {stopping.stop_line(signum)}", file=sys.stderr)
        return stopping.exit_code(signum)
    except BrokenPipeError:  # the reader went away (`clgrpo library show RUN | head`): not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 0
    except Exception as exc:  # noqa: BLE001 - the command's last resort: one error line, the traceback to the log
        if (signum := stopping.requested()) is not None and stopping.is_stop(exc):
            print(f"error: {stopping.stop_line(signum)}", file=sys.stderr)
            return stopping.exit_code(signum)
        user = isinstance(exc, user_errors())
        worded = user or isinstance(exc, worded_errors())
        log = last_log()
        where = f" (details: {log})" if log and not user else ""
        print(f"error: {error_line(exc, with_type=not worded)}{where}", file=sys.stderr)
        return 2 if user else 1


def _flush_standard_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone (a pipe whose reader left): nothing more to write
            pass


def run() -> None:
    """The ``clgrpo`` console script: ``main()``, then exit without tearing the interpreter down.

    After a run, freeing every object of the imported stack (Prefect, pandas, DuckDB, ...) one by one takes
    about 0.6 s on two cores and does nothing a user needs. The exit work that matters still runs, in the order
    Python runs it (threads that must finish, Prefect's log and event workers draining to the API, every
    ``atexit`` handler: the verifier pool, a temporary Prefect server, logging), and then the process ends."""
    code = main()
    _flush_standard_streams()
    join_threads = getattr(threading, "_shutdown", None)
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if join_threads is None or run_exit_handlers is None:  # another Python: the usual exit
        sys.exit(code)
    join_threads()
    run_exit_handlers()
    _flush_standard_streams()
    os._exit(code)


if __name__ == "__main__":
    run()
