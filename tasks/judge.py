"""An LLM judge for domains whose answers are free text (``judge:`` in the run config; the web domain's use).

With ground truth, the judge compares a rollout's final answer (the domain's ``final_answer`` reading, else the
reply's end) with the reference and returns a grade and one sentence of reason, stored with the reward
(``Reward.judge_reason``). Its calls go through the one LLM client as the learner model, stage ``verify`` (or
the evaluation's stage), so they are retried, rate limited and accounted like every call. A reply without a usable
verdict, or a call that failed after its retries, is an ungraded sample (``verified`` False: retried once by the
verify stage, then counted against its tolerance). Without ground truth there is nothing to judge: the verify
stage skips those problems and the group-advantage stage compares the attempts on their own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from clgrpo.llm import LLMClient, shared_client
from clgrpo.llm.client import LLMCallError
from clgrpo.llm.structured import StructuredOutputError, extract_json
from clgrpo.prompts.judge import judge_messages
from domains.base import Domain, VerifyResult
from schemas.config import RunConfig
from schemas.records import Problem

JUDGE_SCHEMA = {
    "type": "object",
    "properties": {"correct": {"type": "boolean"}, "reason": {"type": "string"}},
    "required": ["correct", "reason"],
    "additionalProperties": False,
}
TAIL_CHARS = 1500  # of a reply without a recognisable final answer, what the judge sees


def parse_verdict(text: str) -> tuple[bool, str]:
    """``(correct, reason)`` from the judge's reply; ``StructuredOutputError`` when there is none."""
    payload = extract_json(text)
    correct = payload.get("correct") if isinstance(payload, dict) else None
    if isinstance(correct, str) and correct.strip().lower() in ("true", "false"):
        correct = correct.strip().lower() == "true"
    if not isinstance(correct, bool):
        raise StructuredOutputError('no boolean "correct" in the reply')
    return correct, " ".join(str(payload.get("reason") or "").split())


class Judge:
    """Grades (problem, output) pairs with the learner model; ``grade_batch`` is what the verify stage calls."""

    def __init__(self, llm: LLMClient, domain: Domain, *, stage: str, temperature: float = 0.0) -> None:
        self.llm, self.domain, self.stage, self.temperature = llm, domain, stage, temperature

    def candidate(self, output: str) -> str | None:
        reader = getattr(self.domain, "final_answer", None)
        if reader is not None:
            return reader(output)
        return output.strip()[-TAIL_CHARS:] or None

    async def grade(self, problem: Problem, output: str) -> VerifyResult:
        candidate = self.candidate(output)
        if candidate is None:
            return VerifyResult(0.0, None, "no final answer to judge")
        try:
            reply = await self.llm.complete(
                judge_messages(problem, candidate),
                stage=self.stage,
                json_schema=JUDGE_SCHEMA,
                schema_name="verdict",
                temperature=self.temperature,
            )
            correct, reason = parse_verdict(reply.text)
        except LLMCallError as exc:
            return VerifyResult(0.0, candidate, f"judge call failed: {exc}", verified=False)
        except StructuredOutputError as exc:
            return VerifyResult(0.0, candidate, f"judge reply unusable: {exc}", verified=False)
        return VerifyResult(
            1.0 if correct else 0.0,
            candidate,
            None if correct else "judged wrong",
            reason=reason or ("correct" if correct else "wrong"),
        )

    async def grade_all(self, items: Sequence[tuple[Problem, str]]) -> list[VerifyResult]:
        return list(await asyncio.gather(*[self.grade(problem, output) for problem, output in items]))


def make_judge(config: RunConfig, domain: Domain, stage: str) -> Judge | None:
    """The run's judge (``judge:`` in the config), None when the domain's verifier grades: no judge configured, or
    training without ground truth (``learning.use_groundtruth: false``: the learner compares the attempts itself,
    so the judge's calls are skipped; the domain's own verifier still grades where answers exist, for the report)."""
    if config.judge is None or (stage == "verify" and not config.learning.use_groundtruth):
        return None
    return Judge(shared_client(config), domain, stage=stage, temperature=config.judge.temperature)
