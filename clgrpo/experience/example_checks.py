"""What a worked example's solution must not show, whatever its grade says.

The verifier grades a solution by its *last* answer mark, so a graded-correct solution may still state another answer
before it (a reply that opened with ``<answer> 111 </answer>`` and ended with ``\\boxed{61}``) or show the output of
code it never ran (a fenced ``output`` block in a reply made without tools, its figure invented to match). Shown to a
small model as a solved problem, either teaches the wrong thing: such a solution is not kept as an example. These
are textual checks, model-free and cheap; they complement the verifier, they do not replace it.
"""

from __future__ import annotations

import re

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
INVENTED_OUTPUT = re.compile(r"```\s*output\b", re.IGNORECASE)


def boxed_at(text: str, start: int) -> str | None:
    """The content of the ``\\boxed{...}`` that begins at ``start`` (nested braces kept); None if it never closes."""
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def boxed_values(text: str) -> list[str]:
    """The content of every closed ``\\boxed{...}``, in order."""
    values, start = [], text.find("\\boxed{")
    while start >= 0:
        if (value := boxed_at(text, start)) is not None:
            values.append(value)
        start = text.find("\\boxed{", start + 1)
    return values


def _normal(value: str) -> str:
    return re.sub(r"[\s$]", "", value).rstrip(".").replace("\\!", "").replace("{,}", "")


def stated_answers(text: str) -> list[str]:
    """The distinct final answers ``text`` states (boxed or in ``<answer>`` tags), normalized, in order."""
    marks = [*ANSWER_TAG.findall(text), *boxed_values(text)]
    return list(dict.fromkeys(v for v in map(_normal, marks) if v))


def example_flaw(text: str, *, used_tools: bool = False) -> str | None:
    """Why ``text`` must not be shown as a worked example's solution, or None. ``used_tools``: the attempt really
    called tools (a fenced output block is then what a tool said, not invented)."""
    if len(answers := stated_answers(text)) > 1:
        return "it states more than one final answer (" + ", ".join(repr(a) for a in answers) + ")"
    if not used_tools and INVENTED_OUTPUT.search(text):
        return "it shows the output of code it never ran (a fenced output block, written without a tool)"
    return None
