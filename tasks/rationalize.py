"""Stage: rationalize. Worked examples for problems the policy never solves (STaR's rationalization, arXiv
2203.14465).

A group with no right answer has nothing to contrast, so lessons cannot come from it; where its problem has a
reference answer, the learner is shown the solver's prompt and that answer and writes a solution
(``clgrpo.prompts.rationalize``), which the domain's verifier grades like an attempt. Only a solution whose final
answer the verifier accepts (reward 1) becomes a candidate worked example, an add with ``example`` set, proposed
for the group like the learner's lessons; every other reply is kept with why it was not (``parse_error``).
A request the learner refuses (``PermanentLLMError``: a writer's prompt, the solver's with the answer and the ask,
longer than its context; a request it cannot take) is a rationalization not made (``REFUSED``), stored with why and
warned about in the step's line, not a failed item: asked again it is refused again, and worked examples are an
extra beside the lessons, so it does not stop the run. A call that fails after its retries still is one.
At most ``learning.rationalize_max`` groups per step, chosen in a fixed pseudo-random order. Output: one
``Proposal`` per rationalized group (stored in ``proposals`` under this stage) and the calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from clgrpo.experience.example_checks import example_flaw
from clgrpo.experience.library import EXAMPLE_MAX_WORDS, word_count
from clgrpo.llm import LLMCallError, LLMClient, shared_client
from clgrpo.llm.errors import PermanentLLMError
from clgrpo.process import progress
from clgrpo.prompts.rationalize import rationalize_messages
from domains import Domain, domain_for
from schemas.config import RunConfig
from schemas.records import (
    GroupAdvantage,
    LLMCall,
    Operation,
    OpKind,
    Problem,
    Proposal,
    Reward,
    WorkedExample,
    text_hash,
)
from schemas.stages import Stage
from tasks.common import stage_task
from tasks.group_advantage import CALL_FAILED
from tasks.outputs import Rationales

SOLUTION_WORDS = 100  # what the writer is asked for: a worked example is shown in every prompt of its kind
REFUSED = "rationalization not made: the learner refused the request: "


def unsolved(
    problems: Sequence[Problem], rewards: Sequence[Reward], advantages: Sequence[GroupAdvantage], step: int, most: int
) -> list[Problem]:
    """The groups to rationalize: problems with a reference answer whose every graded attempt scored 0 (at least
    one graded), ``most`` of them in a fixed pseudo-random order of the step."""
    graded: dict[str, list[float]] = {}
    for r in rewards:
        if r.reward is not None:
            graded.setdefault(r.problem_id, []).append(r.reward)
    mixed = {a.problem_id for a in advantages if a.selected}
    chosen = [
        p
        for p in problems
        if p.answer is not None
        and p.problem_id not in mixed
        and graded.get(p.problem_id)
        and not any(graded[p.problem_id])
    ]
    return sorted(chosen, key=lambda p: text_hash(f"rationalize:{step}:{p.problem_id}"))[:most]


async def rationalize_one(
    problem: Problem, domain: Domain, llm: LLMClient, author: str
) -> tuple[Proposal, list[LLMCall]]:
    """One solution written with the reference in view, graded; a candidate example only if it reaches the answer."""
    assert problem.answer is not None
    group = problem.problem_id
    messages = rationalize_messages(domain.rollout_messages(problem, ""), problem.answer, SOLUTION_WORDS)
    try:
        reply = await llm.complete(messages, stage=Stage.RATIONALIZE)
    except LLMCallError as exc:
        failure = REFUSED if refused(exc) else CALL_FAILED
        return Proposal(group_id=group, parse_error=f"{failure}{exc}"), exc.calls
    finally:
        progress.advance(Stage.RATIONALIZE)
    text = reply.text.strip()
    why = _not_kept(text, reply.finish_reason)
    if why is None:
        [grade] = await asyncio.to_thread(domain.verify_batch, [(text, problem.answer)])
        if not grade.verified:
            why = f"the verifier could not grade it: {grade.error}"
        elif grade.reward < 1.0:
            why = f"its final answer {grade.extracted!r} is not the reference (reward {grade.reward:g})"
    if why is not None:
        return Proposal(group_id=group, raw_text=text, parse_error=f"rationalization not kept: {why}"), reply.calls
    example = WorkedExample(
        problem=problem.problem, answer=problem.answer, author=author, reward=1.0, origin="rationalized",
        task_tag=problem.tag,
    )  # fmt: skip
    op = Operation(
        op=OpKind.ADD,
        text=text,
        rationale="worked example: written by the learner with the reference answer in view; the verifier "
        "accepted its final answer (no attempt of the group was right)",
        source_groups=[group],
        example=example,
    )
    return Proposal(group_id=group, operations=[op], raw_text=text), reply.calls


def refused(exc: BaseException) -> bool:
    """Whether a failed call was refused by the learner (a permanent error somewhere in its causes)."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, PermanentLLMError):
            return True
        cause = cause.__cause__
    return False


def was_refused(proposal: Proposal) -> bool:
    """A rationalization the learner refused to take (``REFUSED``)."""
    return (proposal.parse_error or "").startswith(REFUSED)


def _not_kept(text: str, finish_reason: str) -> str | None:
    if not text:
        return "an empty reply"
    if finish_reason == "length":
        return "cut off at the learner's max_tokens"
    if (words := word_count(text)) > EXAMPLE_MAX_WORDS:
        return f"{words} words, more than {EXAMPLE_MAX_WORDS}"
    return example_flaw(text)


async def rationalize(problems: Sequence[Problem], domain: Domain, llm: LLMClient, author: str) -> Rationales:
    parts = await asyncio.gather(*[rationalize_one(p, domain, llm, author) for p in problems])
    return Rationales([p for p, _ in parts], [c for _, calls in parts for c in calls])


@stage_task(Stage.RATIONALIZE, run_name="rationalize-step{step}")
async def rationalize_task(config: RunConfig, step: int, problems: list[Problem]) -> Rationales:
    return await rationalize(problems, domain_for(config), shared_client(config), config.learner_model.model)
