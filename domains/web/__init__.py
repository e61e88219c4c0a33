"""The web domain: questions answered by searching and browsing pages (WebWalkerQA-style), with an optional
reference answer and an optional start page.

Datasets use the core loader's validation (``clgrpo/inputs/dataset.py``) and field settings
(``dataset.problem_field: question``, ``dataset.answer_field: answer`` or null, ``dataset.url_field: root_url``:
the start page is added to the question as "Start page: URL"). Agent rollouts get two tools
(``domains/web/tools.py``). Without a judge, an answer is graded by normalized match: the reference's words, in
order, inside the final answer (``Final answer: ...``).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

from clgrpo.inputs.dataset import LoadReport, load_problems_with_report
from clgrpo.prompts.rollout import ShownExample
from clgrpo.prompts.web_rollout import DOMAIN, EXAMPLE_LESSONS, rollout_messages
from domains.base import Message, Tool, VerifyResult
from domains.learner import LearnerPrompts
from domains.web.settings import WebSettings
from domains.web.tools import web_tools
from schemas.config import DatasetConfig
from schemas.records import Problem

FINAL_ANSWER_RE = re.compile(r"final answer\s*[:\-]\s*(.+)", re.IGNORECASE)


def final_answer(output: str) -> str | None:
    """The text after the last ``Final answer:`` (first line, without trailing markup), or None."""
    found = FINAL_ANSWER_RE.findall(output)
    if not found:
        return None
    answer = found[-1].strip().splitlines()[0].strip().rstrip(".").strip("*_`\"' ").rstrip(".")
    return answer or None


def normalize_answer(text: str) -> str:
    """Lower case, accents and punctuation removed, articles dropped, whitespace collapsed."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode().lower()
    text = re.sub(r"(?<=\d)[,_](?=\d{3})", "", text)  # 1,889 -> 1889
    text = re.sub(r"[^\w\s]", " ", text)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def match_answer(output: str, answer: str) -> VerifyResult:
    found = final_answer(output)
    if found is None:
        return VerifyResult(0.0, None, "no 'Final answer:' line")
    got, want = normalize_answer(found), normalize_answer(str(answer))
    if not want:
        return VerifyResult(0.0, found, "the reference answer is empty", verified=False)
    correct = re.search(rf"(^| ){re.escape(want)}( |$)", got) is not None
    return VerifyResult(1.0 if correct else 0.0, found, None if correct else "does not match the reference")


class WebDomain:
    name = "web"
    grade_truncated = False  # a reply cut off before its final answer line is not an answer

    settings_model = WebSettings  # its own settings: domain_settings in a run config

    def __init__(self, settings: WebSettings | None = None) -> None:
        self.learner_prompts = LearnerPrompts(domain=DOMAIN, examples=EXAMPLE_LESSONS)
        self.settings = settings or WebSettings()

    def load_dataset(self, cfg: DatasetConfig) -> tuple[list[Problem], LoadReport]:
        return load_problems_with_report(cfg)

    def verify(self, output: str, answer: str) -> VerifyResult:
        return match_answer(output, answer)

    def verify_batch(self, items: Sequence[tuple[str, str]]) -> list[VerifyResult]:
        return [match_answer(output, answer) for output, answer in items]

    def warm(self) -> None:
        """Nothing to start: answers are compared as text, in this process."""

    def final_answer(self, output: str) -> str | None:
        """What an LLM judge compares with the reference (``tasks/judge.py``)."""
        return final_answer(output)

    def reply_answer(self, output: str) -> str | None:
        """A production reply's final answer (refresh traces): its ``Final answer:`` line."""
        return final_answer(output)

    def rollout_messages(
        self, problem: Problem, library_text: str, examples: Sequence[ShownExample] = (), form: str = "turns"
    ) -> list[Message]:
        return rollout_messages(problem, library_text, examples, form)

    def tools(self) -> list[Tool]:
        return web_tools(self.settings)
