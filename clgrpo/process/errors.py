"""Errors as one line: what a terminal, a run's status and a flow run's state message show."""

from __future__ import annotations


def one_line(message: str) -> str:
    """A multi-line message (a headline and a list of issues) as one line: the headline and the first item."""
    lines = [line.strip().lstrip("- ").strip() for line in message.splitlines() if line.strip()]
    if len(lines) <= 1:
        return message.strip()
    more = f" (+{len(lines) - 2} more)" if len(lines) > 2 else ""
    return f"{lines[0]}; first: {lines[1]}{more}"


def error_line(exc: BaseException, *, with_type: bool = True) -> str:
    """An exception as one line: its type (unless the message is meant for users as it is) and message."""
    message = one_line(str(exc))
    if not with_type:
        return message or type(exc).__name__
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


class EvaluationError(ValueError):
    """An evaluation that cannot run as asked (nothing to evaluate, a bad id, no overlap to compare)."""
