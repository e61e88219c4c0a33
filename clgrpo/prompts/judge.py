"""The answer judge (``ROLE: answer judge``): does a candidate's final answer say the same as the reference?
Used by domains whose answers are free text (``tasks/judge.py``); the reply is one JSON verdict."""

from __future__ import annotations

from clgrpo.prompts import Message, quoting
from clgrpo.prompts.quoting import DATA_NOTICE
from schemas.records import Problem

JUDGE_SYSTEM = (
    """ROLE: answer judge
You decide whether a candidate's final answer to a question says the same as the reference answer: the same
fact, entity, number or date, whatever the wording, units written out or not, extra explanation or not. An
answer that hedges between several values, or says it does not know, is wrong.
"""
    + DATA_NOTICE
    + """
Reply with one JSON object and nothing else: {"correct": true or false, "reason": "one short sentence"}."""
)

JUDGE_USER = """Question:
{question}

Reference answer:
{reference}

Candidate's final answer:
{candidate}"""


def judge_messages(problem: Problem, candidate: str) -> list[Message]:
    user = JUDGE_USER.format(
        question=quoting.quote("problem", problem.problem),
        reference=quoting.quote("answer", problem.answer or ""),
        candidate=quoting.quote("attempt", candidate),
    )
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]
