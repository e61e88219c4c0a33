"""A candidate over the word limit is shortened by the learner once, instead of being dropped for its length.

Issue 47: 5 of 22 candidates of one run were rejected for length alone (41-53 words against 40). Before its
trial, such a lesson gets one request to the learner (``clgrpo/prompts/shorten.py``, constrained to the lesson
length where the backend enforces JSON schemas); the shorter text replaces it when it is within the limit, its
rationale saying so. When the call fails or the reply is still too long, the lesson goes on as it was, its
rationale saying why it was not shortened, and the library refuses it with its length.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from clgrpo.experience.library import word_count
from clgrpo.llm import LLMClient, shared_client
from clgrpo.llm.client import LLMCallError
from clgrpo.llm.structured import StructuredOutputError, parse_contrast
from clgrpo.prompts.shorten import shorten_messages
from domains import domain_for
from domains.learner import contrast_schema
from schemas.config import LearningConfig, RunConfig
from schemas.records import LLMCall, Operation, OpKind
from schemas.stages import Stage
from tasks.common import stage_task


def lesson_schema(cfg: LearningConfig) -> dict:
    schema = contrast_schema(min_words=cfg.min_words, max_words=cfg.max_words)
    return {**schema, "properties": {"lesson": schema["properties"]["lesson"]}, "required": ["lesson"]}


async def shorten_long(
    plan: Sequence[Operation], eligible: Sequence[int], cfg: LearningConfig, domain: str, llm: LLMClient, stage: str
) -> tuple[list[Operation], list[LLMCall]]:
    """The plan with each eligible lesson over ``cfg.max_words`` shortened once where the learner's reply fits
    (a worked example is kept whole), and the calls."""
    long = [
        seq
        for seq in eligible
        if plan[seq].example is None and word_count(plan[seq].text or "") > cfg.max_words  # a solution stays whole
    ]
    done = await asyncio.gather(*[_shorten(plan[seq], cfg, domain, llm, stage) for seq in long])
    out = list(plan)
    for seq, (op, _) in zip(long, done):
        out[seq] = op
    return out, [c for _, calls in done for c in calls]


async def _shorten(
    op: Operation, cfg: LearningConfig, domain: str, llm: LLMClient, stage: str
) -> tuple[Operation, list[LLMCall]]:
    text = op.text or ""
    words = word_count(text)
    messages = shorten_messages(domain, text, words, cfg.min_words, cfg.max_words)
    try:
        reply = await llm.complete(messages, stage=stage, json_schema=lesson_schema(cfg), schema_name="lesson")
    except LLMCallError as exc:
        return _noted(op, f"not shortened: the learner call failed ({exc})"), exc.calls
    try:
        shorter = " ".join((parse_contrast(reply.text).text or "").split())
    except StructuredOutputError as exc:
        return _noted(op, f"not shortened: the learner's reply has no lesson ({exc})"), reply.calls
    if not cfg.min_words <= word_count(shorter) <= cfg.max_words:
        return _noted(op, f"not shortened: the learner's rewrite has {word_count(shorter)} words"), reply.calls
    note = f"shortened by the learner from {words} to {word_count(shorter)} words"
    return _noted(op.model_copy(update={"text": shorter}), note), reply.calls


def _noted(op: Operation, note: str) -> Operation:
    """The operation with ``note`` in its rationale (stored with the operation, whatever becomes of it)."""
    return op.model_copy(update={"rationale": f"{op.rationale} [{note}]".strip()})


@stage_task(Stage.VALIDATE_LESSONS, run_name="shorten-lessons-step{step}")
async def shorten_plan_task(
    config: RunConfig, step: int, plan: list[Operation]
) -> tuple[list[Operation], list[LLMCall]]:
    """Before the trials: the plan's adds, modifies and merges over the word limit, shortened once."""
    eligible = [seq for seq, op in enumerate(plan) if op.op in (OpKind.ADD, OpKind.MODIFY, OpKind.MERGE)]
    domain = domain_for(config).learner_prompts.domain
    return await shorten_long(plan, eligible, config.learning, domain, shared_client(config), Stage.VALIDATE_LESSONS)
