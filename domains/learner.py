"""Prompt templates of the three semantic stages (summarize, extract group advantage, consolidate).

One place for every learner prompt. A domain supplies a ``LearnerPrompts`` (the default wording takes the
domain's description); the system messages start with a ``ROLE:`` line so logs and test servers can tell
the stages apart. Operations are requested as JSON matching ``OPERATIONS_SCHEMA``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from schemas.records import Problem

Message = dict[str, str]

OP_KINDS = ["add", "modify", "delete", "merge", "keep"]

OPERATIONS_SCHEMA: dict = {
    "type": "object",
    "properties": {
        "operations": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "op": {"type": "string", "enum": OP_KINDS},
                    "ids": {"type": "array", "items": {"type": "string"}},
                    "text": {"type": "string"},
                    "sources": {"type": "array", "items": {"type": "string"}},
                    "why": {"type": "string"},
                },
                "required": ["op"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["operations"],
    "additionalProperties": False,
}


def operations_schema(max_items: int | None = None) -> dict:
    """``OPERATIONS_SCHEMA`` with an upper bound on the number of operations: constrained decoding then has to
    close the list (small models otherwise repeat operations until they run out of tokens)."""
    if max_items is None:
        return OPERATIONS_SCHEMA
    schema = {**OPERATIONS_SCHEMA, "properties": {"operations": dict(OPERATIONS_SCHEMA["properties"]["operations"])}}
    schema["properties"]["operations"]["maxItems"] = max(1, max_items)
    return schema

_SUMMARIZE_SYSTEM = """ROLE: trajectory summarizer
You review one attempt at a {domain} problem and describe it for a colleague who will compare several
attempts at the same problem. Write plain text, at most 150 words:
1. The approach, step by step, in a few short lines.
2. Which listed experiences (by id) the attempt used or ignored, if any were given.
3. {grading_instruction}"""

_SUMMARIZE_GRADED = """Where the attempt went wrong or took a detour, and why; or, if it is correct, what made it work."""
_SUMMARIZE_UNGRADED = """Steps that look doubtful or unverified, and steps that look solid (no grade is available)."""

_SUMMARIZE_USER = """{library_block}Problem:
{problem}
{answer_block}
Attempt{grade_block}:
{attempt}"""

_EXTRACT_SYSTEM = """ROLE: experience extractor
You improve a library of short, general lessons for solving {domain} problems. You see several attempts at
one problem{grading_note}, and the current library. Compare the attempts and find what made the better ones
better. Propose at most {max_ops} operations on the library:
- {{"op": "add", "text": "..."}}: a new lesson;
- {{"op": "modify", "ids": ["E3"], "text": "..."}}: rewrite an existing lesson by its id.
Rules: a lesson is a general strategy ("When ..., do ..."), never a calculation or an answer for this
problem; at most {max_words} words; do not repeat a lesson already in the library.
Reply with JSON only: {{"operations": [{{"op": ..., "ids": [...], "text": ..., "why": ...}}]}}.
If nothing is worth learning, reply {{"operations": []}}."""

_EXTRACT_USER = """Current library:
{library}

Problem ({group_id}):
{problem}
{answer_block}
{attempts}"""

_CONSOLIDATE_SYSTEM = """ROLE: library consolidator
You maintain a library of short, general lessons for solving {domain} problems. Several groups of attempts
proposed edits. Turn all proposals into one final, consistent plan:
- {{"op": "add", "text": "...", "sources": ["group ids"]}}
- {{"op": "modify", "ids": ["E3"], "text": "...", "sources": [...]}}
- {{"op": "merge", "ids": ["E1", "E4"], "text": "...", "sources": [...]}} (two or more existing ids)
- {{"op": "delete", "ids": ["E2"]}}
- {{"op": "keep", "ids": ["E5"]}}
Rules: combine proposals that say the same thing; each lesson general, at most {max_words} words, no
repetition across lessons; use only ids that exist in the current library; never two operations on the same
id. Reply with JSON only: {{"operations": [...]}}."""

_CONSOLIDATE_USER = """Current library:
{library}

Proposals:
{proposals}"""

_REPAIR = """Your previous reply could not be used: {error}
Reply again with JSON only, exactly in this shape: {{"operations": [{{"op": ..., "ids": [...], "text": ..., "why": ...}}]}}."""


@dataclass(frozen=True)
class Attempt:
    """One rollout as the learner sees it."""

    sample_idx: int
    text: str  # the trajectory (summarize) or its summary (extract)
    reward: float | None  # None when grades are hidden (no ground truth)


@dataclass(frozen=True)
class LearnerPrompts:
    domain: str = "general"

    def summarize(self, problem: Problem, attempt: Attempt, library_text: str, use_groundtruth: bool) -> list[Message]:
        graded = use_groundtruth and attempt.reward is not None
        system = _SUMMARIZE_SYSTEM.format(
            domain=self.domain, grading_instruction=_SUMMARIZE_GRADED if graded else _SUMMARIZE_UNGRADED)
        user = _SUMMARIZE_USER.format(
            library_block=f"Experiences given to the solver:\n{library_text}\n\n" if library_text else "",
            problem=problem.problem,
            answer_block=_answer_block(problem, use_groundtruth),
            grade_block=_grade(attempt.reward) if graded else "",
            attempt=attempt.text,
        )
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def extract(self, problem: Problem, attempts: Sequence[Attempt], library_text: str, *, use_groundtruth: bool,
                max_ops: int, max_words: int) -> list[Message]:
        system = _EXTRACT_SYSTEM.format(
            domain=self.domain, max_ops=max_ops, max_words=max_words,
            grading_note=" with their grades and the reference answer" if use_groundtruth else "")
        blocks = [
            f"Attempt {a.sample_idx}{_grade(a.reward) if use_groundtruth and a.reward is not None else ''}:\n{a.text}"
            for a in attempts
        ]
        user = _EXTRACT_USER.format(
            library=library_text or "(empty)", group_id=problem.problem_id, problem=problem.problem,
            answer_block=_answer_block(problem, use_groundtruth), attempts="\n\n".join(blocks))
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    def consolidate(self, proposals_text: str, library_text: str, *, max_words: int) -> list[Message]:
        system = _CONSOLIDATE_SYSTEM.format(domain=self.domain, max_words=max_words)
        user = _CONSOLIDATE_USER.format(library=library_text or "(empty)", proposals=proposals_text)
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]

    @staticmethod
    def repair(messages: list[Message], bad_reply: str, error: str) -> list[Message]:
        return [*messages, {"role": "assistant", "content": bad_reply},
                {"role": "user", "content": _REPAIR.format(error=error)}]


def _answer_block(problem: Problem, use_groundtruth: bool) -> str:
    if use_groundtruth and problem.answer is not None:
        return f"Reference answer: {problem.answer}\n"
    return ""


def _grade(reward: float) -> str:
    return f" (graded {'correct' if reward >= 1.0 else 'wrong' if reward <= 0.0 else f'{reward:.2f}'})"
