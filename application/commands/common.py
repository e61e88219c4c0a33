"""What the commands share: the command objects ``application.cli`` registers, and the pieces several commands use
(the database a command reads, the terminal and log of a command that runs a flow, Prefect's local settings, how a
stopped command is resumed)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from clgrpo.storage.state import resolve_db
from clgrpo.storage.store import Store, parse_library_ref
from schemas.config import RunConfig

DB_HELP = "DuckDB file (default: the most recent database that holds the run, else the most recent one)"


def no_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of a command that takes none."""


@dataclass(frozen=True)
class Command:
    """One command, ``clgrpo NAME`` (or ``clgrpo GROUP NAME``): its help line, its arguments and what runs it
    (``run(args)``, the exit code)."""

    name: str
    help: str
    run: Callable[[argparse.Namespace], int]
    arguments: Callable[[argparse.ArgumentParser], None] = no_arguments

    def register(self, sub: argparse._SubParsersAction) -> None:
        parser = sub.add_parser(self.name, help=self.help)
        self.arguments(parser)
        parser.set_defaults(func=self.run)


@dataclass(frozen=True)
class CommandGroup:
    """A command with subcommands, ``clgrpo NAME SUBCOMMAND``: one of them is required."""

    name: str
    help: str
    commands: tuple[Command, ...]

    def register(self, sub: argparse._SubParsersAction) -> None:
        inner = sub.add_parser(self.name, help=self.help).add_subparsers(dest=f"{self.name}_command", required=True)
        for command in self.commands:
            command.register(inner)


def add_overrides(parser: argparse.ArgumentParser, example: str) -> None:
    """``--set KEY=VALUE`` (repeatable) into ``args.overrides``: a config value for this command only."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a config value, e.g. --set {example} (repeatable)",
    )


def prefect_defaults() -> None:
    """Sensible settings for local use; anything the user set wins."""
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    from application.prefect_server import install

    install(only_if_ephemeral=True)  # a temporary Prefect server dies with this process, even on SIGKILL


def read_store(db: str) -> Store:
    return Store(db, read_only=True)


def db_of(args: argparse.Namespace, ref: str | None = None) -> str:
    """``--db``, else the most recent database that holds the run of ``ref`` (RUN, RUN:VERSION), else the most
    recent database (see ``clgrpo.storage.state``)."""
    return resolve_db(args.db, parse_library_ref(ref)[0] if ref else None)


def default_run_id(prefix: str) -> str:
    from datetime import datetime

    return f"{prefix}-{datetime.now():%Y%m%d-%H%M%S}"


def session(db_path: str, name: str, *, flow_lines: bool = True):  # noqa: ANN201 - a context manager
    """The terminal and log file of a command that runs a flow: ``<db dir>/logs/<name>.log``."""
    from application.terminal import Session

    return Session(Path(db_path).expanduser().resolve().parent / "logs" / f"{name}.log", flow_lines=flow_lines)


def resume_command(run_id: str | None) -> str:
    """This command line again, naming the run id (how a stopped run is resumed)."""
    import shlex

    words = ["clgrpo", *sys.argv[1:]]
    if run_id and "--run-id" not in words and not any(w.startswith("--run-id=") for w in words):
        words += ["--run-id", run_id]
    return shlex.join(words)


def rollout_mode_line(config: RunConfig) -> str:
    """For agent runs: how rollouts are made (empty for direct rollouts)."""
    agent = config.rollout.agent_settings()
    if agent is None:
        return ""
    from domains import domain_for

    domain = domain_for(config)
    names = [t.name for t in domain.tools()]
    limits = []
    if "python" in names:
        limits.append(
            f"python sandbox: {agent.sandbox.cpu_s:g} s CPU, {agent.sandbox.wall_s:g} s wall, "
            f"{agent.sandbox.memory_mb} MB per call"
        )
    if "open" in names and (settings := getattr(domain, "settings", None)) is not None:  # the web domain's
        web = settings.open
        limits.append(
            f"open: {web.timeout_s:g} s, {web.max_bytes // 1000} kB, robots.txt "
            f"{'obeyed' if web.respect_robots else 'ignored'}, private hosts allowed: "
            f"{', '.join(web.allow_hosts) or 'none'}"
        )
    return (
        f"rollouts: agent (tools: {', '.join(names)}; protocol {agent.protocol}; at most {agent.max_turns} "
        f"turns{''.join(f'; {item}' for item in limits)})"
    )
