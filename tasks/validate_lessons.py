"""Stage: lesson validation. Before the plan is applied, each candidate lesson must show that it helps.

For every add, modify or merge of the step's plan that the library's rules would accept (the same screen and
guard as ``apply_operations``; a refused one is left for that stage to reject with its reason), the policy
attempts the candidate's problems ``samples`` times without it (the library as it is) and with it (the plan's
operation applied alone), on the same seeds: its source problems first, then other problems of the step (those
with mixed rewards first), up to ``problems``. A candidate that says (nearly) what an earlier one says is not
tried again: it is rejected as a repeat. It is kept only if the mean reward over the (problem, sample)
pairs graded in both arms rises by more than ``min_gain``; else it is rejected with the numbers. Of the kept
candidates of one group, only the one with the largest gain goes on (a group's contrast candidates are
alternatives). The attempts without the lesson are shared by every candidate of the step.

What is tried, on which problems and in which order is ``tasks.trial_choice``'s; the trials are one sequential
paired trial (``tasks.sequential_trial``, as the library gate's): each candidate an arm against the library as it
is, looked at after every ``problems`` more problems (test ``sign``), within the step's checks budget.

Delete and keep operations are not validated. Output (``tasks.outputs.Trials``): one ``LessonTrial`` per plan
operation, every graded attempt as a ``TrialSample``, the calls; the plan that goes on to ``apply_operations``,
with the rejections to store there, follows from the trials (``tasks.plan``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Literal

from clgrpo.experience.library import ExperienceLibrary, NearDuplicates
from clgrpo.llm import LLMClient, shared_client
from clgrpo.process import progress
from clgrpo.process.words import counted
from clgrpo.reports.metrics import paired_rewards, sign_test
from domains import Domain, domain_for
from schemas.config import LessonValidation, RunConfig
from schemas.records import (
    GroupAdvantage,
    LessonTrial,
    LibraryVersion,
    LLMCall,
    Operation,
    Problem,
    Reward,
    Rollout,
    Sample,
    TrialSample,
)
from schemas.stages import Stage
from tasks.checks_budget import ChecksBudget, tokens
from tasks.common import stage_task
from tasks.measure import (
    Sampling,
    draw_keys,
    graded_sample,
    reusable,
    sample_seeds,
    sampling_at,
)
from tasks.outputs import Trials
from tasks.rollout import prompt_fingerprint
from tasks.sequential_trial import Arm, Reach, SequentialTrial
from tasks.specificity import rate
from tasks.trial_choice import Candidate, Rejected, budget_order, cluster_plan, next_members, quoted, to_try

BASELINE = -1  # TrialSample.seq of the attempts without any candidate


def trial_sampling(config: RunConfig) -> Sampling:
    return sampling_at(config, config.learning.lesson_validation.temperature)


def rollout_baseline(
    config: RunConfig,
    library: ExperienceLibrary,
    problems: Sequence[Problem],
    rollouts: Sequence[Rollout],
    rewards: Sequence[Reward],
    domain: Domain,
) -> dict[str, Sample]:
    """The step's own rollouts as the attempts without any candidate, by the draw key they stand in for: where
    they match (the same prompt, the library as it is; the trial's temperature is the rollouts'; graded by the
    problem's answer or the judge, not by agreement), rollout i of a problem is baseline sample i. Pairs are
    matched by problem and sample index, so they need not share a seed."""
    settings = config.learning.lesson_validation
    if settings.temperature not in (None, config.grpo.rollout_temperature):
        return {}
    sampling = trial_sampling(config)
    keys = draw_keys(problems, library, settings.samples, sample_seeds(problems, config.seed), sampling, domain)
    prompts = {p.problem_id: prompt_fingerprint(p, library, domain, sampling.agent) for p in problems}
    graded = {(g.problem_id, g.sample_idx): g for g in rewards if g.reward_source in ("ground_truth", "judge")}
    found: dict[str, Sample] = {}
    for r in rollouts:
        g = graded.get((r.problem_id, r.sample_idx))
        key = keys.get((r.problem_id, r.sample_idx))
        if g is None or key is None or r.error is not None or r.prompt_hash != prompts[r.problem_id]:
            continue
        found[key] = graded_sample(r, g, 0, key, model=sampling.model).model_copy(
            update={"drawn": False}
        )  # the rollout stage drew it
    return found


def judge_trial(
    candidate: Candidate,
    without: list[TrialSample],
    with_: list[TrialSample],
    settings: LessonValidation,
    *,
    last_look: bool = True,
) -> LessonTrial | None:
    """The verdict on one candidate from its paired attempts so far: kept or rejected (test ``mean``: ties go
    against it; test ``sign``: see ``LessonValidation``), or None while the sign test is undecided before its last
    look."""
    pairs = paired_rewards(without, with_)
    tried = list(dict.fromkeys(s.problem_id for s in with_))
    base = dict(
        seq=candidate.seq, operation=candidate.operation, problem_ids=tried, samples=settings.samples, pairs=len(pairs)
    )
    if not pairs:
        if not last_look:
            return None
        return LessonTrial(
            **base, verdict="rejected", reason="lesson validation: no attempt could be graded in both arms"
        )
    mean_without = sum(a for a, _ in pairs) / len(pairs)
    mean_with = sum(b for _, b in pairs) / len(pairs)
    gain = mean_with - mean_without
    numbers = (
        f"reward {mean_without:.2f} -> {mean_with:.2f} ({gain:+.2f}) on {counted(len(tried), 'problem')} x "
        f"{settings.samples} samples ({len(pairs)} pairs)"
    )
    if settings.test == "sign":
        verdict, reason = _sign_verdict(pairs, numbers, settings, last_look)
        if verdict is None:
            return None
    else:
        kept = gain > settings.min_gain
        verdict = "kept" if kept else "rejected"
        reason = (
            f"validated: {numbers}"
            if kept
            else f"lesson validation: {numbers}, not above learning.lesson_validation.min_gain={settings.min_gain:g}"
        )
    return LessonTrial(
        **base, mean_without=mean_without, mean_with=mean_with, gain=gain, verdict=verdict, reason=reason
    )


def _sign_verdict(
    pairs: list[tuple[float, float]], numbers: str, settings: LessonValidation, last_look: bool
) -> tuple[Literal["kept", "rejected"] | None, str]:
    """The sequential sign test's call: kept, rejected (harmful, or no effect at the last look), or undecided."""
    better = sum(b > a for a, b in pairs)
    worse = sum(b < a for a, b in pairs)
    p_better, p_worse = sign_test(better, worse)
    level = settings.alpha / settings.looks
    test = f"{better} better, {worse} worse; sign test p={min(p_better, p_worse):.3f}, level {level:.3g}"
    if p_better < level and better > worse:
        return "kept", f"validated: {numbers}; {test}"
    if p_worse < level and worse > better:
        return "rejected", f"lesson validation: {numbers}; {test}: worse"
    if last_look:
        return "rejected", f"lesson validation: {numbers}; {test}: no effect"
    return None, ""


def _kept_gain(trial: LessonTrial) -> float:
    """A kept trial's gain, rounded so that equal gains compare equal (0.67 -> 1.00 and 0.33 -> 0.67 differ in
    the last bit: without rounding the one that comes out larger wins a tie the lesson rater should break)."""
    assert trial.gain is not None, "judge_trial gives every kept trial its gain"
    return round(trial.gain, 9)


def best_per_group(trials: list[LessonTrial], specific: AbstractSet[int] = frozenset()) -> list[LessonTrial]:
    """Of the kept trials of one kind (lessons, worked examples) that share a source group, only the one with the
    largest gain stays kept (ties: the one the lesson rater called specific (``specific``: their seqs), then the
    first in the plan); the others become rejections naming it."""

    def rank(t: LessonTrial) -> tuple[float, bool]:
        return _kept_gain(t), t.seq in specific

    def rivals(t: LessonTrial) -> list[tuple[str, str]]:  # a lesson and an example of one group are no rivals
        kind = "lesson" if t.operation.example is None else "example"
        return [(g, kind) for g in t.operation.source_groups or [f"#{t.seq}"]]

    best: dict[tuple[str, str], LessonTrial] = {}
    for t in trials:
        if t.verdict == "kept":
            for group in rivals(t):
                if group not in best or rank(t) > rank(best[group]):
                    best[group] = t
    out = []
    for t in trials:
        winners = {best[g].seq for g in rivals(t) if g in best}
        if t.verdict == "kept" and winners and winners != {t.seq}:
            other = next(best[g] for g in rivals(t) if g in best and best[g].seq != t.seq)
            how = (
                "more"
                if _kept_gain(other) > _kept_gain(t)
                else "as much with a specific lesson (the lesson rater)"
                if other.seq in specific
                else "as much and comes first in the plan"
            )
            groups = ",".join(t.operation.source_groups)
            t = t.model_copy(
                update={
                    "verdict": "rejected",
                    "reason": (
                        f"lesson validation: another candidate of group {groups} gained {how} "
                        f"({quoted(other.operation)}: {other.gain:+.2f} against {t.gain:+.2f})"
                    ),
                }
            )
        out.append(t)
    return out


async def validate_lessons(
    config: RunConfig,
    step: int,
    library: ExperienceLibrary,
    plan: list[Operation],
    problems: list[Problem],
    advantages: list[GroupAdvantage],
    domain: Domain,
    llm: LLMClient,
    pool: Sequence[Problem] = (),
    near: NearDuplicates | None = None,
    ledger: Sequence[Rejected] = (),
    drawn: StepDraws | None = None,
    budget: ChecksBudget | None = None,
    gated: bool = False,
) -> Trials:
    """``pool``: the run's training problems (``trials_on: others`` draws from them); ``near``: the near-duplicate
    control, so a candidate is tried as it would be applied (merged into the lesson it repeats); ``ledger``: the
    lessons earlier steps rejected by measurement, not tried again; ``drawn``: what was drawn already (the step's
    rollouts, earlier trials' samples), read instead of drawn again where the draw keys match; ``budget``: what
    the trials may spend (``tasks.checks_budget``): a candidate whose attempts do not fit is rejected untried;
    ``gated``: the step has a library gate, which tries its worked examples (``trial_choice.GATE_TRIES_EXAMPLES``)."""
    settings = config.learning.lesson_validation
    tried_plan, clustered, ranked, cluster_calls = await cluster_plan(
        config, step, library, plan, problems, near, ledger, llm, domain, gated
    )
    candidates, untested, repeats = to_try(
        config, library, tried_plan, problems, advantages, step, pool, near, ledger, clustered, gated=gated
    )
    trials = [
        LessonTrial(seq=seq, operation=tried_plan[seq], verdict="untested", reason=why) for seq, why in untested.items()
    ]
    lessons = LessonTrials(
        config, library, domain, llm, budget.after(tokens(cluster_calls)) if budget is not None else None
    )
    for attempt in range(settings.cluster_tries):
        if attempt:  # a cluster whose member was rejected: its next member, until one is kept
            candidates = next_members(
                config, library, plan, ranked, attempt, lessons.decided, problems, advantages, step, pool, near
            )
            repeats = {seq: why for seq, why in repeats.items() if seq not in {c.seq for c in candidates}}
        if not candidates:
            break
        tried = _all_problems(candidates)
        await lessons.run(candidates, drawn.known(config, library, tried, domain) if drawn is not None else {})
    trials += [
        LessonTrial(seq=seq, operation=plan[seq], verdict="rejected", reason=why) for seq, why in repeats.items()
    ]
    trials = sorted(trials + list(lessons.decided.values()), key=lambda t: t.seq)
    specific, rater_calls = await _rate_ties(trials, llm, domain)
    trials = best_per_group(trials, specific)
    return Trials(trials, lessons.trial.samples, cluster_calls + lessons.trial.calls + rater_calls)


class LessonTrials:
    """Lesson trials as one sequential trial (``tasks.sequential_trial``): each candidate an arm, the library as
    it is the baseline every candidate shares, each judged by ``judge_trial``; a later ``run`` (the next members
    of clusters) shares the attempts before it."""

    def __init__(
        self,
        config: RunConfig,
        library: ExperienceLibrary,
        domain: Domain,
        llm: LLMClient,
        budget: ChecksBudget | None = None,
    ) -> None:
        self.settings = s = config.learning.lesson_validation
        self.candidates: dict[Hashable, Candidate] = {}
        self.trial: SequentialTrial[TrialSample, LessonTrial] = SequentialTrial(
            config,
            Stage.VALIDATE_LESSONS,
            trial_sampling(config),
            domain,
            llm,
            baseline=Arm(BASELINE, library, _as_trial_sample(BASELINE)),
            looks=[Reach(s.problems * look, s.samples) for look in range(1, s.looks + 1)],
            decide=self.judge,
            stopped=self.stopped,
            budget=budget,
            order=self.admission_order,
        )

    @property
    def decided(self) -> dict[int, LessonTrial]:
        """The verdicts so far, by plan position."""
        return {t.seq: t for t in self.trial.verdicts.values()}

    def arm(self, candidate: Candidate) -> Arm[TrialSample]:
        self.candidates[candidate.seq] = candidate
        return Arm(candidate.seq, candidate.library, _as_trial_sample(candidate.seq), candidate.problems)

    async def run(self, candidates: Sequence[Candidate], known: Mapping[str, Sample]) -> None:
        """Trials of ``candidates`` look by look until each is decided; ``known``: samples read, not drawn."""
        self.trial.known.update(known)
        await self.trial.run([self.arm(c) for c in candidates])

    def judge(
        self, arm: Arm[TrialSample], without: list[TrialSample], with_: list[TrialSample], look: int, last: bool
    ) -> LessonTrial | None:
        return judge_trial(self.candidates[arm.name], without, with_, self.settings, last_look=last)

    def stopped(
        self, arm: Arm[TrialSample], without: list[TrialSample], with_: list[TrialSample], look: int, note: str
    ) -> LessonTrial:
        """The verdict on a candidate the budget stops: rejected untried, or judged on its attempts so far (a look
        the budget stopped while it drew: on what it drew)."""
        candidate, per_look = self.candidates[arm.name], self.settings.problems
        cut = self.trial.cut
        in_part = cut is not None and cut.look == look and bool(with_)
        if not in_part:
            # its look's samples are counted on the stage's progress though never drawn, as lesson trials always did
            unmeasured = candidate.problems[per_look * (look - 1) : per_look * look]
            progress.expect(Stage.VALIDATE_LESSONS, len(unmeasured) * self.settings.samples)
        if not with_:
            return LessonTrial(
                seq=candidate.seq,
                operation=candidate.operation,
                verdict="rejected",
                reason=f"not tried: {note}",  # not a measurement: not in the ledger, tried again later
            )
        trial = judge_trial(candidate, without, with_, self.settings, last_look=True)
        assert trial is not None, "the last look always decides"
        where = f"look {look} {cut.describe()}" if in_part and cut is not None else f"look {look} not drawn"
        return trial.model_copy(update={"reason": f"{trial.reason}; {where}: {note}"})

    def admission_order(self, arms: list[Arm[TrialSample]]) -> list[Arm[TrialSample]]:
        by_seq = {a.name: a for a in arms}
        return [by_seq[c.seq] for c in budget_order([self.candidates[a.name] for a in arms], self.settings)]


def _as_trial_sample(seq: int) -> Callable[[Sample], TrialSample]:
    return lambda s: TrialSample(**s.model_dump(), seq=seq)


async def _rate_ties(trials: list[LessonTrial], llm: LLMClient, domain: Domain) -> tuple[set[int], list[LLMCall]]:
    """The seqs of the kept candidates the lesson rater calls specific, asked only where kept candidates of one
    group tie on their gain (the rater breaks the tie)."""
    by_group: dict[str, list[LessonTrial]] = defaultdict(list)
    for t in trials:
        if t.verdict == "kept":
            for group in t.operation.source_groups:
                by_group[group].append(t)
    tied = {
        t.seq: t
        for group in by_group.values()
        for t in group
        if sum(_kept_gain(other) == max(_kept_gain(x) for x in group) for other in group) > 1
        and _kept_gain(t) == max(_kept_gain(x) for x in group)
    }
    if not tied:
        return set(), []
    ratings, calls = await rate(
        [t.operation.text or "" for t in tied.values()],
        llm,
        domain=domain.learner_prompts.domain,
        stage=Stage.VALIDATE_LESSONS,
    )
    return {seq for seq, r in zip(tied, ratings) if r.verdict == "specific"}, calls


def _all_problems(candidates: Sequence[Candidate]) -> list[Problem]:
    return list({p.problem_id: p for c in candidates for p in c.problems}.values())


@dataclass(frozen=True)
class StepDraws:
    """What a step drew before its trials: its rollouts (with their rewards) and this run's earlier samples."""

    rollouts: list[Rollout] = field(default_factory=list)
    rewards: list[Reward] = field(default_factory=list)
    earlier: list[Sample] = field(default_factory=list)

    def known(
        self, config: RunConfig, library: ExperienceLibrary, problems: Sequence[Problem], domain: Domain
    ) -> dict[str, Sample]:
        return {
            **reusable(self.earlier),
            **rollout_baseline(config, library, problems, self.rollouts, self.rewards, domain),
        }


@stage_task(Stage.VALIDATE_LESSONS, run_name="validate-lessons-step{step}")
async def validate_lessons_task(
    config: RunConfig,
    step: int,
    library: LibraryVersion,
    plan: list[Operation],
    problems: list[Problem],
    advantages: list[GroupAdvantage],
    pool: list[Problem] | None = None,
    near: NearDuplicates | None = None,
    ledger: list[Rejected] | None = None,
    drawn: StepDraws | None = None,
    budget: ChecksBudget | None = None,
    gated: bool = False,
) -> Trials:
    return await validate_lessons(
        config,
        step,
        ExperienceLibrary.from_version(library),
        plan,
        problems,
        advantages,
        domain_for(config),
        shared_client(config),
        pool or [],
        near,
        ledger or [],
        drawn,
        budget,
        gated,
    )
