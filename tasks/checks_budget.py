"""What a step's checks may spend (``learning.checks_budget``), strictly.

A step's own work is its rollouts and its learner calls; its checks are the lesson trials (with the calls that
shorten and cluster the candidates) and the library gate. Together the checks spend at most ``checks_budget``
times the step's own tokens, so a step with its checks costs at most 1 + ``checks_budget`` times the same step
without them, whatever the candidates or the gate's looks: in every run with direct rollouts, not on average.

The gate measures the whole step, so its samples are reserved first: every look's samples not already drawn, at the
tokens of one of the step's rollouts (prompt and reply), or of one of the gate's own samples drawn beside the
rollouts where those cost more (the whole library in every prompt, fewer samples a request); the library after's
samples also at what the step's candidates are expected to add to each prompt (``added_prompt``: the longest worked
examples a prompt may show, and a lesson), the whole times ``RESERVE_MARGIN`` (replies vary). Trials spend what is
left, candidate by candidate in the plan's order: one whose samples are not expected to fit is rejected untried,
saying so. The gate always begins its first look and draws a further look only if its samples are expected to fit
what is left (at the tokens its own samples took so far); else it decides at the look it has, saying so.

What a sample is expected to cost is an estimate; what it can cost at most is not: its prompt (at most a token per
byte of the rendered messages, and the chat template's few) and ``max_tokens`` per reply (``tasks.measure``'s
``worst_cost``; an agent's sample, many turns each re-reading the ones before, is admitted by the estimate alone).
Every request of a check is sent only if that most fits what is left (``Allowance``): a trial or a gate look whose
samples turn out longer than expected is stopped at its share (its last request asks for the samples that fit), its
remaining requests not sent, and it is decided on what it drew, saying so. Nothing a check sends can take the step
past its budget; what it costs is that the last stretch of a share, less than one request's worst case, may go
unspent.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from clgrpo.experience.tokens import estimate_tokens
from clgrpo.process.words import counted
from schemas.records import LLMCall, Operation, OpKind

RESERVE_MARGIN = 1.25


def tokens(calls: Sequence[LLMCall]) -> int:
    return sum(c.tokens_in + c.tokens_out for c in calls)


def added_prompt(plan: Sequence[Operation], examples_shown: int) -> int:
    """What a library after ``plan`` is expected to add to one prompt (estimated tokens): its ``examples_shown``
    longest worked examples (problem and solution; the trials leave examples to the gate) and its longest lesson
    (the trials keep few of the lessons they try; the gate's looks stop at their share where more are kept)."""
    writes = [op for op in plan if op.op in (OpKind.ADD, OpKind.MODIFY, OpKind.MERGE) and op.text]
    lessons = [estimate_tokens(op.text or "") for op in writes if op.example is None]
    examples = sorted(
        (estimate_tokens(op.example.problem + " " + (op.text or "")) for op in writes if op.example is not None),
        reverse=True,
    )
    return max(lessons, default=0) + sum(examples[:examples_shown])


@dataclass(frozen=True)
class ChecksBudget:
    """The tokens a step's checks may spend (``allowed``, None: no limit), what one policy sample is expected to
    cost (``per_sample``: the step's rollouts' tokens per rollout), the part kept for the gate (``gate_reserve``)
    and what the checks spent before the current stage (``spent``)."""

    ratio: float | None
    allowed: int | None
    per_sample: float
    gate_reserve: int = 0
    spent: int = 0

    @classmethod
    def of(
        cls,
        ratio: float | None,
        own_tokens: int,
        rollout_tokens: int,
        rollouts: int,
        gate_samples: int = 0,
        gate_per_sample: float = 0.0,
        after_samples: int = 0,
        after_prompt: float = 0.0,
    ) -> ChecksBudget:
        """``gate_samples``: the samples the gate would draw at all its looks (0: no gate this step), priced at
        ``gate_per_sample`` (what the gate's samples drawn so far cost each) where that is more than a rollout;
        ``after_samples`` of them (the library after's) at ``after_prompt`` tokens more each."""
        per_sample = rollout_tokens / rollouts if rollouts else 0.0
        allowed = None if ratio is None else int(ratio * own_tokens)
        reserve = (gate_samples * max(per_sample, gate_per_sample) + after_samples * after_prompt) * RESERVE_MARGIN
        return cls(ratio, allowed, per_sample, math.ceil(reserve))

    def left(self, spent_here: int = 0, *, reserve: bool = True) -> float:
        """Tokens still free for the current stage after ``spent_here`` (trials: the gate's reserve kept)."""
        if self.allowed is None:
            return math.inf
        return self.allowed - self.spent - spent_here - (self.gate_reserve if reserve else 0)

    def fits(self, samples: int, per_sample: float, spent_here: int = 0, *, reserve: bool = True) -> bool:
        return samples * per_sample <= self.left(spent_here, reserve=reserve)

    def for_gate(self, spent_by_trials: int) -> ChecksBudget:
        """What the gate may spend once the trials (and the calls around them) spent ``spent_by_trials``: what is
        left of the budget (its reserve, since the trials cannot spend it)."""
        return replace(self, gate_reserve=0, spent=self.spent + spent_by_trials)

    def after(self, spent: int) -> ChecksBudget:
        return replace(self, spent=self.spent + spent)

    def allowance(self, spent_here: int = 0, *, reserve: bool = True) -> Allowance | None:
        """What the current stage's next draws may spend at most, strictly (None: no limit)."""
        return None if self.allowed is None else Allowance(max(0, int(self.left(spent_here, reserve=reserve))))

    def describe(self, spent_here: int = 0, *, reserve: bool = True) -> str:
        """The budget and what is left of it, for a reason."""
        left = max(0, int(self.left(spent_here, reserve=reserve)))
        kept = f", {self.gate_reserve:,} of them kept for the library gate" if reserve and self.gate_reserve else ""
        return (
            f"the step's checks budget (learning.checks_budget={self.ratio:g}: {self.allowed or 0:,} tokens{kept}) "
            f"has {counted(left, 'token')} left"
        )


class Allowance:
    """What one look of a check may spend, strictly: a request is sent only when the most it can cost fits beside
    what was spent and what the requests in flight may still cost (``reserve``); its real cost replaces that when
    it returns (``settle``). Requests are admitted in the order they ask. The first that does not fit even with
    nothing in flight asks for as many of its samples as fit (maybe none) and stops the look: no later request is
    sent (``stopped``; ``refused``: what the whole request could have cost). What is sent depends on the real costs
    of the requests before it, never on timing."""

    def __init__(self, tokens: int) -> None:
        self.limit = tokens
        self.spent = 0
        self.held = 0  # the most the requests in flight may still cost
        self.stopped = False
        self.refused = 0
        self._asked = 0  # tickets handed out, in the order requests asked
        self._served = 0  # tickets decided
        self._changed = asyncio.Condition()

    def _fits(self, worst: int) -> bool:
        return self.spent + self.held + worst <= self.limit

    def _decidable(self, worst: int) -> bool:
        """Whether a request of at most ``worst`` can be answered now: it fits, or nothing in flight can free room."""
        return self.stopped or self._fits(worst) or self.held == 0

    async def reserve(self, once: int, each: int, n: int) -> int:
        """How many of ``n`` samples a request may ask for, when it costs at most ``once`` plus ``each`` a sample:
        ``n``, or fewer (maybe 0) when it is the one that stops the look. What it may cost is held until
        ``settle``."""
        whole = once + n * each
        async with self._changed:
            ticket = self._asked
            self._asked += 1
            await self._changed.wait_for(lambda: self._served == ticket and self._decidable(whole))
            self._served += 1
            self._changed.notify_all()
            if self.stopped:
                return 0
            if self._fits(whole):
                self.held += whole
                return n
            self.stopped, self.refused = True, whole
            room = self.limit - self.spent - once
            granted = min(n - 1, max(0, room // each)) if each > 0 and room > 0 else 0
            if granted:
                self.held += once + granted * each
            return granted

    async def settle(self, worst: int, cost: int) -> None:
        """A request that held ``worst`` came back having cost ``cost``."""
        async with self._changed:
            self.held -= worst
            self.spent += cost
            self._changed.notify_all()


class GrowingAllowance(Allowance):
    """An allowance whose limit follows the step's own tokens while they come in (``grow``): a request that does
    not fit yet waits until it does; ``close`` ends it, and a request still waiting then is not sent. For what a
    check draws beside the step (the library gate's first look at the library before, ``tasks.library_gate``): the
    samples it could not draw early are drawn by the check itself, under its own allowance."""

    def __init__(self) -> None:
        super().__init__(0)

    def _decidable(self, worst: int) -> bool:
        return self.stopped or self._fits(worst)

    async def grow(self, limit: int) -> None:
        async with self._changed:
            self.limit = max(self.limit, limit)
            self._changed.notify_all()

    async def close(self) -> None:
        async with self._changed:
            self.stopped = True
            self._changed.notify_all()
