"""Structured output: a tolerant JSON extractor and the operations contract.

Models wrap JSON in code fences, add comments, trailing commas or prose; the extractor copes with all of
those and raises ``StructuredOutputError`` with a reason otherwise. Parsed items are validated into
``Operation`` records; an invalid reply gets one repair re-ask (see ``clgrpo.llm.client``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError

from schemas.records import Operation, OpKind


class StructuredOutputError(ValueError):
    pass


_FENCE_RE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)```", re.DOTALL)
_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL)
_TRAILING_COMMA_RE = re.compile(r",(\s*[}\]])")


def _strip_comments(text: str) -> str:
    """Remove // and /* */ comments that are outside JSON strings."""
    out: list[str] = []
    i, n, in_str = 0, len(text), False
    while i < n:
        ch = text[i]
        if in_str:
            out.append(ch)
            if ch == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 1
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
            out.append(ch)
        elif text.startswith("//", i):
            while i < n and text[i] != "\n":
                i += 1
            continue
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = n if end < 0 else end + 2
            continue
        else:
            out.append(ch)
        i += 1
    return "".join(out)


def _balanced_spans(text: str) -> Iterable[str]:
    """Candidate JSON objects/arrays: balanced {...} or [...] spans, outermost first, respecting strings."""
    for start, opener in ((i, c) for i, c in enumerate(text) if c in "{["):
        closer = "}" if opener == "{" else "]"
        depth, in_str, escape = 0, False, False
        for j in range(start, len(text)):
            ch = text[j]
            if in_str:
                escape = (ch == "\\") and not escape
                if ch == '"' and not escape:
                    in_str = False
                continue
            if ch == '"':
                in_str = True
            elif ch == opener:
                depth += 1
            elif ch == closer:
                depth -= 1
                if depth == 0:
                    yield text[start : j + 1]
                    break


# a lone backslash before b, f, r or t and another letter is LaTeX (\\text, \\frac, \\boxed, \\right), not a
# JSON escape: models write it unescaped, and json.loads would turn "\\text" into a tab and "ext"
_LATEX_ESCAPE_RE = re.compile(r"(?<!\\)((?:\\\\)*)\\(?=[bfrt][A-Za-z])")


def _latex_escapes(text: str) -> str:
    return _LATEX_ESCAPE_RE.sub(lambda m: m.group(1) + "\\\\", text)


def _loads_lenient(candidate: str) -> Any:
    cleaned = _latex_escapes(_TRAILING_COMMA_RE.sub(r"\1", _strip_comments(candidate)).strip())
    return json.loads(cleaned)


def extract_json(text: str) -> Any:
    """The first JSON value found in a model reply (fenced or not), tolerating comments and trailing commas."""
    if not text or not text.strip():
        raise StructuredOutputError("empty reply")
    body = _THINK_RE.sub("", text)
    candidates = [m.group(1) for m in _FENCE_RE.finditer(body)] + [body]
    for candidate in candidates:
        try:
            return _loads_lenient(candidate)
        except json.JSONDecodeError:
            pass
        for span in _balanced_spans(_strip_comments(candidate)):
            try:
                return _loads_lenient(span)
            except json.JSONDecodeError:
                continue
    raise StructuredOutputError("no JSON object found in the reply")


_KEYS = {
    "op": ("op", "operation", "action", "type"),
    "target_ids": ("ids", "id", "target_ids", "targets", "target", "experience_ids"),
    "text": ("text", "content", "experience", "lesson"),
    "rationale": ("why", "rationale", "reason"),
    "source_groups": ("sources", "source_groups", "groups"),
}


def _pick(item: dict, names: tuple[str, ...]) -> Any:
    for name in names:
        if name in item and item[name] is not None:
            return item[name]
    return None


def operation_from_item(item: Any, allowed: Iterable[OpKind]) -> Operation:
    if not isinstance(item, dict):
        raise StructuredOutputError(f"operation must be an object, got {type(item).__name__}")
    fields = {field: _pick(item, names) for field, names in _KEYS.items()}
    kind = str(fields["op"] or "").strip().lower()
    allowed_values = [k.value for k in allowed]
    if kind not in allowed_values:
        raise StructuredOutputError(f"op {kind or '(missing)'!r} is not one of {allowed_values}")
    fields["op"] = kind
    fields["rationale"] = str(fields["rationale"] or "")
    if fields["text"] is not None:
        fields["text"] = str(fields["text"])
    try:
        return Operation(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        raise StructuredOutputError(f"invalid operation {item}: {exc.errors()[0]['msg']}") from exc


LEARNER_OPS = tuple(k for k in OpKind if k != OpKind.EVICT)  # evictions come from the token budget only


def parse_operations(text: str, allowed: Iterable[OpKind] = LEARNER_OPS) -> list[Operation]:
    """``{"operations": [...]}`` (or a bare list) -> validated operations; raises on any invalid item."""
    payload = extract_json(text)
    if isinstance(payload, dict):
        items = payload.get("operations")
        if items is None:
            raise StructuredOutputError('expected {"operations": [...]}')
    else:
        items = payload
    if not isinstance(items, list):
        raise StructuredOutputError('"operations" must be a list')
    allowed = tuple(allowed)
    return [operation_from_item(item, allowed) for item in items]


_LESSON_LINE_RE = re.compile(r"^\s*(?:\*\*)?lesson(?:\*\*)?\s*:\s*(.+)$", re.IGNORECASE | re.MULTILINE)
_DIFFERENCE_LINE_RE = re.compile(
    r"^\s*(?:\*\*)?(?:difference|mistake)(?:\*\*)?\s*:\s*(.+)$", re.IGNORECASE | re.MULTILINE
)


def parse_contrast(text: str, live_ids: Iterable[str] = ()) -> Operation:
    """A contrast reply -> one operation: ``{"difference", "lesson", "revises"}`` as JSON (or, from a model
    that ignored the format, ``Lesson: ...`` and ``Difference: ...`` lines). A lesson that revises a live id is
    a modify of it, else an add; the difference becomes the rationale. Raises when there is no lesson."""
    lesson, difference, revises = _contrast_fields(text)
    lesson = " ".join(lesson.split())
    if not lesson:
        raise StructuredOutputError("the reply has no lesson")
    rationale = " ".join(difference.split())
    if revises and revises in set(live_ids):
        return Operation(op=OpKind.MODIFY, target_ids=[revises], text=lesson, rationale=rationale)
    return Operation(op=OpKind.ADD, text=lesson, rationale=rationale)


def _contrast_fields(text: str) -> tuple[str, str, str]:
    try:
        payload = extract_json(text)
    except StructuredOutputError:
        payload = None
    if isinstance(payload, dict):
        lesson = _pick(payload, ("lesson", "rule", "experience", "text"))
        if isinstance(lesson, str):
            difference = _pick(payload, ("difference", "mistake", "why", "rationale"))
            revises = _pick(payload, ("revises", "modifies", "id"))
            return lesson, str(difference or ""), str(revises or "").strip()
    found = _LESSON_LINE_RE.search(text or "")
    if found is None:
        raise StructuredOutputError('no JSON object with a "lesson" and no "Lesson:" line in the reply')
    difference = _DIFFERENCE_LINE_RE.search(text)
    return found.group(1), difference.group(1) if difference else "", ""
