"""What a command-line user sees while a flow runs, and where the details go.

``Session`` sets up one CLI command: every log record (with tracebacks) goes to a log file; the terminal keeps
Prefect's progress lines and warnings, without tracebacks and without the engine's own failure lines (the
command ends with one ``error:`` line instead); stage progress is drawn as rich progress bars on a terminal,
or as a line per quarter when the output is a file or a pipe.
"""

from __future__ import annotations

import copy
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING

from clgrpo.process import progress, stopping

if TYPE_CHECKING:
    from prefect.logging.handlers import PrefectConsoleHandler
    from rich.console import Console
    from rich.progress import TaskID

PROJECT_LOGGERS = ("clgrpo", "domains", "tasks", "flows")
ENGINE_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")  # where a flow's get_run_logger() lines go
_last_log: list[Path] = []  # the log file of the most recent session in this process
_ENGINE_FAILURE_LINES = (
    "Encountered exception during execution",
    "Finished in state Failed",
    "Finished in state Crashed",
)


class NoTraceback(logging.Formatter):
    """Formats with the wrapped formatter, leaving out the exception and stack (they are in the log file)."""

    def __init__(self, inner: logging.Formatter | None) -> None:
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info or record.exc_text or record.stack_info:
            record = copy.copy(record)
            record.exc_info = record.exc_text = record.stack_info = None
        return self.inner.format(record)


class TerminalFilter(logging.Filter):
    """Prefect's records and warnings from anything else; not the engine's failure lines, nor, once a stop
    signal came, the engine's lines about what it cancelled (the command's ``error:`` line says it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if stopping.stopping() and record.levelno >= logging.WARNING:
            return False
        if record.name.startswith("prefect") and record.levelno >= logging.ERROR:
            message = record.getMessage()
            if message.startswith(_ENGINE_FAILURE_LINES):
                return False
        return record.name.startswith("prefect") or record.levelno >= logging.WARNING


class FlowLines(logging.Handler):
    """The flows' own INFO lines (a stage stored, a step's summary), plain, without Prefect's timestamps; the
    engine's own INFO lines (task runs started and finished) stay in the log file."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.engine_dir = _prefect_dir()

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING or record.pathname.startswith(self.engine_dir):
            return  # warnings reach the terminal through Prefect's console handler
        try:
            sys.stderr.write(f"{record.getMessage()}\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass


def _prefect_dir() -> str:
    import prefect

    return str(Path(prefect.__file__).parent)


def last_log() -> Path | None:
    """The log file of the most recent command session in this process (where a failure's traceback is)."""
    return _last_log[0] if _last_log else None


def console_handlers() -> list[PrefectConsoleHandler]:
    from prefect.logging.handlers import PrefectConsoleHandler

    return [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]


@dataclass
class Session:
    """One command's terminal and log file. Use as a context manager around the command's work."""

    log_path: Path
    bars: bool | None = None  # None: rich bars when stderr is a terminal
    flow_lines: bool = True  # the flows' own INFO lines on the terminal (the demo draws its own)
    _file: logging.Handler | None = field(default=None, init=False)
    _lines: FlowLines | None = field(default=None, init=False)
    _renderer: RichBars | MilestoneLines | None = field(default=None, init=False)
    # Prefect's console handlers and the stream each drew on before: given back when the command ends
    _consoles: list[tuple[PrefectConsoleHandler, IO[str]]] = field(default_factory=list, init=False)

    def __enter__(self) -> "Session":
        import prefect  # noqa: F401  (configures Prefect's logging, which is adjusted below)

        _last_log[:] = [self.log_path]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._file = logging.FileHandler(self.log_path, encoding="utf-8")
        self._file.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
        logging.getLogger().addHandler(self._file)
        for name in PROJECT_LOGGERS:
            logger = logging.getLogger(name)
            if logger.level == logging.NOTSET or logger.level > logging.INFO:
                logger.setLevel(logging.INFO)
        for handler in console_handlers():
            self._consoles.append((handler, handler.console.file))
            handler.console.file = sys.stderr  # this command's terminal (Prefect bound the one of its first import)
            handler.setLevel(max(handler.level, logging.WARNING))  # Prefect's INFO lines: in the log file
            if not isinstance(handler.formatter, NoTraceback):
                handler.setFormatter(NoTraceback(handler.formatter))
            if not any(isinstance(f, TerminalFilter) for f in handler.filters):
                handler.addFilter(TerminalFilter())
        if self.flow_lines:
            self._lines = FlowLines()
            for name in ENGINE_LOGGERS:
                logger = logging.getLogger(name)
                logger.addHandler(self._lines)
                if logger.getEffectiveLevel() > logging.INFO:
                    logger.setLevel(logging.INFO)
        handlers = console_handlers()
        console = handlers[0].console if handlers else None
        use_bars = self.bars if self.bars is not None else bool(console and console.is_terminal)
        self._renderer = RichBars(console) if use_bars and console else MilestoneLines()
        progress.add_listener(self._renderer)
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        progress.finish_all()
        if exc is not None and self._file is not None:  # the traceback goes to the file only
            self._file.handle(
                logging.LogRecord(
                    "clgrpo.cli",  # the logger name the log file has always shown
                    logging.ERROR,
                    __file__,
                    0,
                    "command failed: %s",
                    (exc,),
                    (type(exc), exc, exc.__traceback__),
                )
            )
        if self._renderer is not None:
            progress.remove_listener(self._renderer)
            self._renderer.stop()
        if self._lines is not None:
            for name in ENGINE_LOGGERS:
                logging.getLogger(name).removeHandler(self._lines)
        if self._file is not None:
            logging.getLogger().removeHandler(self._file)
            self._file.close()
        # the command's terminal may be gone once it ends (a test's captured stream, a notebook cell's): a later
        # flow in this process warns where Prefect's console wrote before (it printed "--- Logging error ---")
        for handler, stream in self._consoles:
            handler.console.file = stream
        self._consoles.clear()


class RichBars:
    """One rich progress bar per open stage (done / expected, elapsed time), drawn on Prefect's own console so
    that log lines print above the bars."""

    def __init__(self, console: Console) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bars = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[unit]}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        self.tasks: dict[str, TaskID] = {}
        self.started = False

    def __call__(self, p: progress.StageProgress) -> None:
        key = p.label
        if p.finished:
            task = self.tasks.pop(key, None)
            if task is not None:
                self.bars.remove_task(task)
            return
        if not self.started:
            self.bars.start()
            self.started = True
        if key not in self.tasks:
            self.tasks[key] = self.bars.add_task(key, total=p.total or None, unit=p.unit)
        self.bars.update(self.tasks[key], completed=p.done, total=p.total or None)

    def stop(self) -> None:
        if self.started:
            self.bars.stop()


class MilestoneLines:
    """Without a terminal: a line when a stage starts, then when it has passed another quarter of its expected
    items (printed at the next update at least ``settle_s`` later, so a batch that finishes many items at once
    prints nothing: its stage line says it), and, while a stage prints nothing for ``heartbeat_s`` (a local
    model generating its first batch), a line with how long it has been running."""

    def __init__(self, quarters: int = 4, settle_s: float = 1.0, heartbeat_s: float = 30.0) -> None:
        self.quarters = quarters
        self.settle_s = settle_s
        self.heartbeat_s = heartbeat_s
        self.printed: dict[str, int] = {}  # label -> quarters printed
        self.pending: dict[str, float] = {}  # label -> when an unprinted quarter was reached
        self.open: dict[str, tuple[progress.StageProgress, float, float]] = {}  # label -> (last, started, printed)
        self.lock = threading.Lock()
        self.closed = threading.Event()
        threading.Thread(target=self._heartbeat, name="clgrpo-progress-heartbeat", daemon=True).start()

    def __call__(self, p: progress.StageProgress) -> None:
        now = time.monotonic()
        with self.lock:
            if p.finished:
                self.printed.pop(p.label, None)
                self.pending.pop(p.label, None)
                self.open.pop(p.label, None)
                return
            if p.label not in self.open:
                self.open[p.label] = (p, now, now)
                self._write(f"  {p.label}: started" + (f", {p.total} {p.unit} expected" if p.total else ""))
                return
            _, started, last = self.open[p.label]
            self.open[p.label] = (p, started, last)
            if p.total <= 0:
                return
            reached = min(self.quarters - 1, p.done * self.quarters // p.total)
            if reached <= self.printed.get(p.label, 0):
                return
            since = self.pending.setdefault(p.label, now)
            if now - since >= self.settle_s:
                self.printed[p.label] = reached
                del self.pending[p.label]
                self.open[p.label] = (p, started, now)
                self._write(f"  {p.label}: {p.done}/{p.total} {p.unit}")

    def _heartbeat(self) -> None:
        while not self.closed.wait(min(self.heartbeat_s, 5.0)):
            now = time.monotonic()
            with self.lock:
                for label, (p, started, last) in list(self.open.items()):
                    if p.total > 0 and now - last >= self.heartbeat_s:  # (a stage still waiting for work: quiet)
                        self.open[label] = (p, started, now)
                        self._write(f"  {label}: {p.done}/{p.total} {p.unit} after {_duration(now - started)}")

    def stop(self) -> None:
        self.closed.set()

    @staticmethod
    def _write(line: str) -> None:
        try:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"
