"""A sequential paired trial: arms (a library each) measured look by look against one baseline arm, each decided
as soon as its pairs so far say enough.

Lesson trials (``tasks.validate_lessons``: many candidate arms sharing the library as it is) and the library gate
(``tasks.library_gate``: the library after the step against the library before it) run this one procedure, each
with its own decision rule:

- Looks. Look n reaches, in every arm, its first ``Reach.problems`` problems at ``Reach.samples`` samples each:
  what an undecided arm has not measured that far is measured at that look, and the baseline arm wherever such
  an arm needs it (one baseline for every arm). Then the rule (``decide``) judges each arm measured at this look
  on its pairs so far: a verdict, or None to look again; an arm's last look (nothing more to measure) decides.
- Reuse. Samples are measured by ``tasks.measure``: one draw per draw key, and what is ``known`` (stored by
  earlier steps, the step's own rollouts) is read instead of drawn. Arms measured ``together`` read only what was
  known before; else each sample is drawn once in the trial: a look's arms draw at once what no arm before them
  shows the same prompt, then read the rest from that arm's draws (two libraries can show a problem the same
  prompt: a worked example is not shown to every problem), and a look that asks more samples of a problem reads
  the ones its earlier looks drew. A sample this trial drew stays stored as drawn, whichever look of its arm read
  it again; another arm that reads it stores it as its own sample, read. Samples of an arm drawn before the trial
  (``add``: the gate's library before, drawn beside the step's rollouts) count as the trial's own draws.
- The checks budget (``tasks.checks_budget``). Before a look that is not ``free``, the arms are admitted in
  ``order`` while what they would draw (with the baseline samples they need, counted once) fits what is left, at
  the tokens per sample of the trial's draws so far (before any: the step's rollouts'); an arm that does not fit
  is measured no further and decided by the rule's ``stopped``, given what is left of the budget. That is an
  estimate; with direct rollouts the limit is strict: every look (a free one too) draws through an ``Allowance``
  of what is left, which sends a request only if the most it can cost fits. A look it stops (``cut``) draws
  nothing more, and neither does the trial: every arm of that look is decided by ``stopped`` on what it drew (the
  rule may word it from ``cut``), and so is any arm a later ``run`` brings. (An agent's sample is many turns whose
  most is far beyond what they cost: agent rollouts are admitted by the estimate alone.)
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.llm import LLMClient
from clgrpo.process import progress
from clgrpo.storage.journal import active, recording
from domains import Domain
from schemas.config import RunConfig
from schemas.records import LLMCall, Problem, Sample
from schemas.stages import Stage
from tasks.checks_budget import Allowance, ChecksBudget, tokens
from tasks.judge import make_judge
from tasks.measure import Measured, Sampling, measure, reusable, sample_seeds, to_draw
from tasks.rollout import prompt_fingerprint

R = TypeVar("R", bound=Sample)  # an arm's sample record (a trial sample, a gate sample)
V = TypeVar("V")  # a verdict on an arm


@dataclass(frozen=True)
class Reach:
    """How far a look reaches in each arm: its first ``problems`` problems (None: all) at ``samples`` samples
    each. ``free``: drawn whatever the checks budget says."""

    problems: int | None
    samples: int
    free: bool = False


@dataclass(frozen=True, eq=False)
class Arm(Generic[R]):
    """A library measured on ``problems`` (in the order they are tried; the baseline's follow the other arms'),
    its samples stored as ``record`` makes them."""

    name: Hashable
    library: ExperienceLibrary
    record: Callable[[Sample], R]
    problems: Sequence[Problem] = ()


@dataclass(frozen=True)
class Cut:
    """A look the checks budget's allowance stopped while it drew: ``drawn`` of its ``wanted`` samples."""

    look: int
    drawn: int
    wanted: int

    def describe(self) -> str:
        return f"drawn in part ({self.drawn} of {self.wanted} samples)"


Work = list[tuple[Arm[R], list[Problem]]]  # arms and the problems each measures
# the rule: (arm, the baseline's samples on its problems, its samples, look, whether it is the arm's last look)
Decide = Callable[[Arm[R], list[R], list[R], int, bool], V | None]
# the verdict on an arm the budget stops at a look: (arm, baseline samples, its samples, look, what is left)
Stopped = Callable[[Arm[R], list[R], list[R], int, str], V]


@dataclass
class SequentialTrial(Generic[R, V]):
    """Arms against ``baseline`` at each of ``looks``, judged by ``decide`` (by ``stopped`` where the budget stops
    one), measured on ``stage`` with ``sampling``. ``together``: a look's arms are measured at once, each reading
    only what is ``known``; else at once too, but a sample two arms share (the same prompt) is drawn for the first
    (the baseline first) and read by the others. The outcome: ``verdicts``, ``samples``, ``calls``; a later ``run``
    with other arms shares all three."""

    config: RunConfig
    stage: Stage
    sampling: Sampling
    domain: Domain
    llm: LLMClient
    baseline: Arm[R]
    looks: Sequence[Reach]
    decide: Decide[R, V]
    stopped: Stopped[R, V]
    budget: ChecksBudget | None = None
    order: Callable[[list[Arm[R]]], list[Arm[R]]] = list  # the order in which the budget admits arms
    together: bool = True
    known: dict[str, Sample] = field(default_factory=dict)  # stored samples by draw key, read instead of drawn
    verdicts: dict[Hashable, V] = field(default_factory=dict)  # by arm name
    calls: list[LLMCall] = field(default_factory=list)
    # (arm, problem) -> its samples; what this trial drew, by draw key, and how many
    _rows: dict[tuple[Hashable, str], list[R]] = field(default_factory=dict, init=False, repr=False)
    # by arm and draw key: an arm that reads another arm's draw (the same prompt) keeps a record of its own
    _drawn: dict[tuple[Hashable, str | None], R] = field(default_factory=dict, init=False, repr=False)
    _draws: int = field(default=0, init=False, repr=False)
    _undrawn: int = field(default=0, init=False, repr=False)  # samples the allowance kept from being drawn
    cut: Cut | None = field(default=None, init=False)  # the look the budget stopped, if it did
    _cut_note: str = field(default="", init=False, repr=False)

    @property
    def samples(self) -> list[R]:
        """Every arm's samples, in the order they were first measured (a problem measured again: the latest)."""
        return [r for rows in self._rows.values() for r in rows]

    def samples_of(self, arm: Arm[R]) -> list[R]:
        return [r for (name, _), rows in self._rows.items() if name == arm.name for r in rows]

    def baseline_of(self, samples: Sequence[R]) -> list[R]:
        """The baseline's samples on the problems of ``samples``, in their order."""
        ids = dict.fromkeys(s.problem_id for s in samples)
        return [r for pid in ids for r in self._rows.get((self.baseline.name, pid), [])]

    def add(self, arm: Arm[R], measured: Measured) -> None:
        """Samples of ``arm`` measured before the trial ran, kept as if a look had drawn them."""
        self._keep(arm, measured)

    async def run(self, arms: Sequence[Arm[R]]) -> None:
        """Look after look until every arm is decided (earlier runs' arms, baseline and samples are shared)."""
        for look in range(1, len(self.looks) + 1):
            undecided = [a for a in arms if a.name not in self.verdicts]
            if not undecided:
                return
            if self.cut is not None:  # the budget is spent: nothing more is drawn
                for arm in undecided:
                    self._stop(arm, look, self._cut_note)
                return
            await self.look(look, undecided)

    async def look(self, look: int, arms: list[Arm[R]]) -> None:
        """The arms the budget admits measured as far as ``look`` reaches, with the baseline they need, and
        judged."""
        reach = self.looks[look - 1]
        admitted = arms if reach.free else self.affordable(look, arms)
        if not admitted:
            return
        fresh = {a.name: self._fresh(a, reach) for a in admitted}
        base = self._baseline_needs(admitted, fresh, reach.samples)
        wanted = (len(base) + sum(len(f) for f in fresh.values())) * reach.samples
        progress.expect(self.stage, wanted)
        # strict where a request's most is known (direct rollouts); an agent's many turns: the estimate alone
        allowance = None if self.budget is None or self.sampling.agent else self.budget.allowance(tokens(self.calls))
        undrawn = self._undrawn
        work = [(self.baseline, base), *[(a, fresh[a.name]) for a in admitted]]
        await self._measure(work, reach.samples, allowance)
        if allowance is not None and allowance.stopped:
            assert self.budget is not None
            self.cut = Cut(look, wanted - (self._undrawn - undrawn), wanted)
            self._cut_note = (
                f"{self.budget.describe(tokens(self.calls))}, less than its next draw could cost at most "
                f"({allowance.refused:,} tokens)"
            )
        for arm in admitted:
            mine, last = self.samples_of(arm), self._last(arm, look)
            complete = self.cut is None or self._complete(arm, reach)
            verdict = self.decide(arm, self.baseline_of(mine), mine, look, last) if complete else None
            assert verdict is not None or not last or not complete, "the last look always decides"
            if verdict is not None:
                self.verdicts[arm.name] = verdict
            elif self.cut is not None:  # no later look: decided on what it drew
                self._stop(arm, look, self._cut_note)

    def _stop(self, arm: Arm[R], look: int, note: str) -> None:
        mine = self.samples_of(arm)
        self.verdicts[arm.name] = self.stopped(arm, self.baseline_of(mine), mine, look, note)

    def _complete(self, arm: Arm[R], reach: Reach) -> bool:
        """Whether ``arm`` and the baseline hold every sample of ``arm``'s problems this look reaches."""
        window = self._window(arm, reach)
        return all(min(self._reached(arm, p), self._reached(self.baseline, p)) >= reach.samples for p in window)

    def affordable(self, look: int, arms: list[Arm[R]]) -> list[Arm[R]]:
        """The arms whose samples at ``look`` (and the baseline samples they need) fit the budget, admitted in
        ``order``; each other one is decided here (``stopped``)."""
        budget, reach = self.budget, self.looks[look - 1]
        if budget is None or budget.allowed is None:
            return arms
        k, spent = reach.samples, tokens(self.calls)
        per_sample = spent / self._draws if self._draws else budget.per_sample
        admitted: set[Hashable] = set()
        claimed: set[str] = set()  # baseline problems an arm admitted before pays for
        cost = 0.0
        for arm in self.order(arms):
            fresh = self._fresh(arm, reach)
            base = [p for p in fresh if p.problem_id not in claimed and self._reached(self.baseline, p) < k]
            draws = self._to_draw(arm, fresh, k) + self._to_draw(self.baseline, base, k)
            if budget.fits(draws, per_sample, spent + math.ceil(cost)):
                cost += draws * per_sample
                claimed |= {p.problem_id for p in base}
                admitted.add(arm.name)
            else:
                mine = self.samples_of(arm)
                note = budget.describe(spent + math.ceil(cost))
                self.verdicts[arm.name] = self.stopped(arm, self.baseline_of(mine), mine, look, note)
        return [a for a in arms if a.name in admitted]

    def _reached(self, arm: Arm[R], problem: Problem) -> int:
        return len(self._rows.get((arm.name, problem.problem_id), ()))

    def _window(self, arm: Arm[R], reach: Reach) -> Sequence[Problem]:
        return arm.problems if reach.problems is None else arm.problems[: reach.problems]

    def _fresh(self, arm: Arm[R], reach: Reach) -> list[Problem]:
        """The problems ``arm`` measures at a look reaching ``reach``."""
        return [p for p in self._window(arm, reach) if self._reached(arm, p) < reach.samples]

    def _last(self, arm: Arm[R], look: int) -> bool:
        """Whether no later look measures more of ``arm``."""
        now, end = self.looks[look - 1], self.looks[-1]
        return len(self._window(arm, now)) == len(self._window(arm, end)) and now.samples == end.samples

    def _baseline_needs(self, arms: list[Arm[R]], fresh: dict[Hashable, list[Problem]], k: int) -> list[Problem]:
        """The baseline's problems ``arms`` measure at this look that it has not measured ``k`` times, in the
        order of the arms' problems."""
        wanted = {p.problem_id for problems in fresh.values() for p in problems}
        return [p for p in _problems(arms) if p.problem_id in wanted and self._reached(self.baseline, p) < k]

    def _to_draw(self, arm: Arm[R], problems: Sequence[Problem], k: int) -> int:
        seeds = sample_seeds(problems, self.config.seed)
        return to_draw(problems, arm.library, k, seeds, self.sampling, self.domain, self.known)

    async def _measure(self, work: list[tuple[Arm[R], list[Problem]]], k: int, allowance: Allowance | None) -> None:
        # the trial's calls are logged, not its items: a retry of the stage redoes it whole
        with recording(active(), stage=self.stage, items=False):
            if self.together:
                done = await asyncio.gather(*[self._attempts(arm, problems, k, allowance) for arm, problems in work])
                for (arm, _), measured in zip(work, done):
                    self._keep(arm, measured)
            else:
                alone, shared = self._by_prompt(work)
                drawn = await asyncio.gather(*[self._attempts(arm, problems, k, allowance) for arm, problems in alone])
                for (arm, _), measured in zip(alone, drawn):
                    self._keep(arm, measured)
                for arm, problems in shared:  # read from the draws above
                    self._keep(arm, await self._attempts(arm, problems, k, allowance))

    def _by_prompt(self, work: list[tuple[Arm[R], list[Problem]]]) -> tuple[Work[R], Work[R]]:
        """Each arm's problems in two: those it shows a prompt no arm before it in ``work`` shows (drawn at once,
        all arms together) and the others (read afterwards from the arm before it that draws them)."""
        seen: set[tuple[str, str]] = set()
        alone: Work[R] = []
        shared: Work[R] = []
        for arm, problems in work:
            prompts = {
                p.problem_id: prompt_fingerprint(p, arm.library, self.domain, self.sampling.agent) for p in problems
            }
            mine = [p for p in problems if (p.problem_id, prompts[p.problem_id]) not in seen]
            others = [p for p in problems if (p.problem_id, prompts[p.problem_id]) in seen]
            alone += [(arm, mine)] if mine else []
            shared += [(arm, others)] if others else []
            seen |= set(prompts.items())
        return alone, shared

    async def _attempts(self, arm: Arm[R], problems: list[Problem], k: int, allowance: Allowance | None) -> Measured:
        return await measure(
            problems,
            arm.library,
            k,
            sample_seeds(problems, self.config.seed),
            self.sampling,
            self.domain,
            self.llm,
            stage=self.stage,
            known=self.known.get,
            judge=make_judge(self.config, self.domain, self.stage),
            allowance=allowance,
        )

    def _keep(self, arm: Arm[R], measured: Measured) -> None:
        self._draws += sum(s.drawn for s in measured.samples)
        self._undrawn += measured.undrawn
        records = [arm.record(s) for s in measured.samples]
        records = [r if r.drawn else self._drawn.get((arm.name, r.draw_key), r) for r in records]
        self._drawn |= {(arm.name, r.draw_key): r for r in records if r.drawn}
        by_problem: dict[str, list[R]] = {}
        for r in records:
            by_problem.setdefault(r.problem_id, []).append(r)
        for pid, rows in by_problem.items():
            self._rows[(arm.name, pid)] = rows
        if not self.together:
            self.known |= reusable(records)
        self.calls += measured.calls


def _problems(arms: Sequence[Arm]) -> list[Problem]:
    """The arms' problems, each once, in the order they first come."""
    return list({p.problem_id: p for a in arms for p in a.problems}.values())
