"""What the learner prompts show of a problem and its attempts: the reference answer, the library, each attempt
(its trajectory with tool calls cut to size, its tool trace, its grade) and ``clip``, the head-and-tail cut that
agent rollouts also apply to tool results."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from clgrpo.prompts import quoting
from schemas.records import Problem, Turn

TOOL_PART_CHARS = 400  # of one tool call or result in the summarizer's view of a trajectory
TRAJECTORY_CHARS = 12_000  # of a whole trajectory shown to the summarizer
TRACE_PART_CHARS = 120  # of a call or result in the extractor's one-line-per-call tool trace
TRACE_CALLS = 8  # calls listed in that trace (the rest are counted)


def clip(text: str, limit: int) -> str:
    """``text`` whole when short, else its head and tail with the cut marked."""
    text = text.strip()
    if len(text) <= limit:
        return text
    head, tail = (limit * 2) // 3, limit // 3
    return f"{text[:head]} [... {len(text) - head - tail} characters cut ...] {text[-tail:]}"


def _call_body(turn: Turn) -> str:
    """A tool call's arguments as written: the code of a one-argument call, else the JSON."""
    try:
        arguments = json.loads(turn.content)
    except json.JSONDecodeError:
        return turn.content
    if isinstance(arguments, dict) and len(arguments) == 1 and isinstance(next(iter(arguments.values())), str):
        return next(iter(arguments.values()))
    return turn.content


def _result_body(turn: Turn) -> str:
    error = f"Error: {turn.error}" if turn.error else ""
    return "\n".join(part for part in (turn.content.strip(), error) if part) or "(no output)"


def trajectory_text(turns: Sequence[Turn]) -> str:
    """An attempt as the summarizer reads it. A direct answer is its text; an agent trajectory lists its replies,
    tool calls and tool results in order, each tool part cut to ``TOOL_PART_CHARS`` (head and tail), the whole
    to ``TRAJECTORY_CHARS``."""
    if not any(t.kind != "assistant" for t in turns):
        return "\n\n".join(t.content for t in turns)
    parts = []
    for t in turns:
        if t.kind == "assistant" and t.content.strip():
            parts.append(f"[reply {t.turn + 1}]\n{t.content.strip()}")
        elif t.kind == "tool_call":
            parts.append(f"[{t.tool_name} call]\n{clip(_call_body(t), TOOL_PART_CHARS)}")
        elif t.kind == "tool_result":
            mark = " (error)" if t.error else " (output cut)" if t.truncated else ""
            parts.append(f"[{t.tool_name} result{mark}]\n{clip(_result_body(t), TOOL_PART_CHARS)}")
    return clip("\n".join(parts), TRAJECTORY_CHARS)


def tool_trace(turns: Sequence[Turn]) -> str:
    """The tool calls of an attempt, one line each (``name: call -> result``), for the extractor, which
    otherwise sees only the summary. Empty when no tool was called."""
    results = {t.call_id: t for t in turns if t.kind == "tool_result"}
    calls = [t for t in turns if t.kind == "tool_call"]
    lines = []
    for call in calls[:TRACE_CALLS]:
        result = results.get(call.call_id)
        outcome = "(no result)" if result is None else clip(_result_body(result), TRACE_PART_CHARS)
        code = clip(_call_body(call), TRACE_PART_CHARS).replace("\n", "; ")
        lines.append(f"- {call.tool_name}: {code} -> {outcome.replace(chr(10), ' / ')}")
    if len(calls) > TRACE_CALLS:
        lines.append(f"- ... {len(calls) - TRACE_CALLS} more tool calls")
    return "\n".join(lines)


@dataclass(frozen=True)
class Attempt:
    """One rollout as the learner sees it."""

    sample_idx: int
    text: str  # the trajectory (the attempt itself, its tool calls and results)
    reward: float | None  # None when grades are hidden (no ground truth)
    truncated: bool = False  # the reply was cut off at the token limit before it finished
    tools: str = ""  # the attempt's tool calls (``tool_trace``); empty: no tool was called
    summary: str = ""  # the summarizer's account of it (extractor), when there is one

    @property
    def with_tools(self) -> str:
        """What the extractor is shown: the summary (if any), the attempt itself, then its tool trace."""
        body = f"Summary: {self.summary}\n\nThe attempt itself:\n{self.text}" if self.summary else self.text
        return f"{body}\nTool calls:\n{self.tools}" if self.tools else body

    @property
    def mark(self) -> str:
        return " (cut off at the token limit before it finished)" if self.truncated else ""


def answer_block(problem: Problem, use_groundtruth: bool) -> str:
    if use_groundtruth and problem.answer is not None:
        return f"Reference answer:\n{quoting.quote('answer', problem.answer)}\n"
    return ""


def library_block(library_text: str) -> str:
    return quoting.quote("library", library_text) if library_text.strip() else "(empty)"


def grade_label(reward: float) -> str:
    return f" (graded {'correct' if reward >= 1.0 else 'wrong' if reward <= 0.0 else f'{reward:.2f}'})"
