"""Specific or generic: the lesson rater's verdict on lesson texts (``clgrpo/prompts/specificity.py``).

Lesson validation asks it only when candidates of one group measured the same gain (the specific one is kept);
``benchmarks/learning.py`` asks it about every kept lesson to count the generic ones. The rater is the learner
model at temperature 0 with a constrained JSON reply; a failed call or an unusable reply is "unrated" (never
counted as either).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from clgrpo.llm import LLMClient
from clgrpo.llm.client import LLMCallError
from clgrpo.llm.structured import StructuredOutputError, extract_json
from clgrpo.prompts.specificity import rater_messages
from schemas.records import LLMCall

RATER_SCHEMA = {
    "type": "object",
    "properties": {"verdict": {"type": "string", "enum": ["specific", "generic"]}, "reason": {"type": "string"}},
    "required": ["verdict", "reason"],
    "additionalProperties": False,
}
Verdict = Literal["specific", "generic", "unrated"]


@dataclass(frozen=True)
class Rating:
    lesson: str
    verdict: Verdict
    reason: str


def parse_rating(lesson: str, text: str) -> Rating:
    try:
        payload = extract_json(text)
    except StructuredOutputError as exc:
        return Rating(lesson, "unrated", f"unusable reply: {exc}")
    verdict = str(payload.get("verdict", "")).strip().lower() if isinstance(payload, dict) else ""
    if verdict not in ("specific", "generic"):
        return Rating(lesson, "unrated", f"no verdict in the reply: {text[:120]!r}")
    return Rating(lesson, verdict, " ".join(str(payload.get("reason") or "").split()))  # type: ignore[arg-type]


async def rate(
    lessons: Sequence[str], llm: LLMClient, *, domain: str, stage: str
) -> tuple[list[Rating], list[LLMCall]]:
    """One rating per lesson, in order, and the calls they took."""

    async def one(lesson: str) -> tuple[Rating, list[LLMCall]]:
        try:
            reply = await llm.complete(
                rater_messages(domain, lesson),
                stage=stage,
                json_schema=RATER_SCHEMA,
                schema_name="rating",
                temperature=0.0,
            )
        except LLMCallError as exc:
            return Rating(lesson, "unrated", f"rater call failed: {exc}"), []
        return parse_rating(lesson, reply.text), reply.calls

    done = await asyncio.gather(*[one(lesson) for lesson in lessons])
    return [r for r, _ in done], [c for _, calls in done for c in calls]
