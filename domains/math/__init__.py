"""The math domain: problems with a single final answer, graded with math-verify.

Grading functions live in ``domains.math.verify`` (not re-exported here, so that name stays the module).
"""

from __future__ import annotations

from collections.abc import Sequence

from clgrpo.inputs.dataset import (
    DatasetError,
    LoadReport,
    load_problems,
    load_problems_with_report,
    normalize_problem_text,
)
from clgrpo.prompts.math_rollout import DOMAIN, EXAMPLE_LESSONS, ROLLOUT_SYSTEM, rollout_messages
from clgrpo.prompts.rollout import ShownExample
from domains.base import Message, Tool, VerifyResult
from domains.learner import LearnerPrompts
from domains.math.tools import PYTHON_TOOL
from domains.math.verify import reply_answer, verify_output, warm_pool
from domains.math.verify import verify_batch as verify_outputs
from schemas.config import DatasetConfig
from schemas.records import Problem

__all__ = [
    "ROLLOUT_SYSTEM",
    "EXAMPLE_LESSONS",
    "DatasetError",
    "LoadReport",
    "MathDomain",
    "load_problems",
    "load_problems_with_report",
    "normalize_problem_text",
    "rollout_messages",
]


class MathDomain:
    """Competition-style problems with one final answer; rollouts answer in \\boxed{}."""

    name = "math"

    def __init__(self, verify_timeout_s: float = 5.0) -> None:  # per sample: CPU seconds in the grading child
        self.verify_timeout_s = verify_timeout_s
        self.learner_prompts = LearnerPrompts(domain=DOMAIN, examples=EXAMPLE_LESSONS)

    def load_dataset(self, cfg: DatasetConfig) -> tuple[list[Problem], LoadReport]:
        return load_problems_with_report(cfg)

    def verify(self, output: str, answer: str) -> VerifyResult:
        return verify_output(output, answer, timeout_s=self.verify_timeout_s)

    def verify_batch(self, items: Sequence[tuple[str, str]]) -> list[VerifyResult]:
        return verify_outputs(items, timeout_s=self.verify_timeout_s)

    def reply_answer(self, output: str) -> str | None:
        """A production reply's final answer (the boxed expression, else the last number): refresh traces."""
        return reply_answer(output)

    def warm(self) -> None:
        """Start the math-verify pool in the background, so the first batch does not wait for it."""
        warm_pool()

    def rollout_messages(
        self, problem: Problem, library_text: str, examples: Sequence[ShownExample] = (), form: str = "turns"
    ) -> list[Message]:
        return rollout_messages(problem, library_text, examples, form)

    def tools(self) -> list[Tool]:
        return [PYTHON_TOOL]
