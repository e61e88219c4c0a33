"""Stage: the library gate. A step's changes are adopted only if they do not make the policy worse.

When a run starts, a share of its training problems (per task tag) is set aside (``split_for_gate``): no step
trains on them, so no rollout, lesson or trial of training sees them. After lesson validation, the library as
it was and the library with the step's plan applied answer every set-aside problem ``samples`` times on the same
seeds (paired attempts). The comparison (``clgrpo.reports.metrics.compare``): the mean reward of each arm over the pairs
graded in both, the difference with a paired-bootstrap CI over problems, and an exact one-sided sign test over the
pairs that differ (the G samples of a problem are repeated trials, so the noise estimate is never zero; with few
pairs the exact binomial tail is the honest test). ``decide`` applies ``learning.library_gate.rule``, per task
tag too.

The gate is a sequential paired trial (``tasks.sequential_trial``, as lesson trials are; ``gate_trial``): the
library after against the library before, more samples of every problem at each look, the first look always
drawn (its look at the library before beside the step's rollouts: ``draw_before``) and a later one only within
the step's checks budget. Attempts are measured by ``tasks.measure``: a sample
is drawn once for its key (library content, problem, seed, sampling settings), so the attempts of the library a
step starts from are read back from the earlier step that measured it, not redone.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, replace

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.llm import LLMClient, shared_client
from clgrpo.process.words import counted
from clgrpo.reports.metrics import Comparison, compare
from domains import Domain, domain_for
from schemas.config import LibraryGate, RunConfig
from schemas.records import GateDecision, GateSample, LibraryVersion, Problem, Sample, text_hash
from schemas.stages import Stage
from tasks.checks_budget import Allowance, ChecksBudget
from tasks.common import stage_task
from tasks.judge import make_judge
from tasks.measure import Measured, Sampling, measure, reusable, sample_seeds, sampling_at, to_draw
from tasks.outputs import Gate
from tasks.sequential_trial import Arm, Reach, SequentialTrial

UNTAGGED = "(untagged)"
GATE_OFF = (
    "library gate: off (learning.library_gate.enabled: false): no step is checked against the library it changes, "
    "so the run's library may answer worse than none"
)


# --- the problems set aside ----------------------------------------------------------------------------------
def split_for_gate(
    problems: Sequence[Problem], settings: LibraryGate, seed: int
) -> tuple[list[Problem], list[Problem]]:
    """(learned from, set aside): of each task tag's problems, ``share`` (at least ``min_problems``, and never
    all of them) set aside, chosen by a hash of the seed and the problem id (the same whatever the order).
    ``enabled: auto``: only tags of at least twice ``min_problems`` problems, each keeping ``min_problems`` to
    learn from; smaller ones are learned from whole."""
    by_tag: dict[str, list[Problem]] = defaultdict(list)
    for p in problems:
        by_tag[p.tag or UNTAGGED].append(p)
    aside: set[str] = set()
    for group in by_tag.values():
        size = min(len(group) - 1, max(settings.min_problems, round(settings.share * len(group))))
        if settings.enabled == "auto":
            size = min(size, len(group) - settings.min_problems) if len(group) >= 2 * settings.min_problems else 0
        ranked = sorted(group, key=lambda p: text_hash(f"gate:{seed}:{p.problem_id}"))
        aside |= {p.problem_id for p in ranked[: max(size, 0)]}
    return [p for p in problems if p.problem_id not in aside], [p for p in problems if p.problem_id in aside]


def describe_split(settings: LibraryGate, learn: Sequence[Problem], aside: Sequence[Problem]) -> tuple[str, bool]:
    """What the gate does in a run, in one line, and whether it gates every task tag (else the line is a
    warning): the problems set aside, the tags learned from whole (``enabled: auto``, too few problems), or that
    it is off for the run because no tag could be split."""
    least = 2 * settings.min_problems
    if not aside:
        return (
            f"library gate: off for this run: no task tag has {least} training problems ({settings.min_problems} to "
            f"set aside, the rest to learn from; {len(learn)} problems in all), so no step is checked against the "
            "library it changes; add problems, or set learning.library_gate.enabled: false to say so"
        ), False
    note = (
        f"library gate: {counted(len(aside), 'training problem')} set aside (never trained on), "
        f"{counted(len(learn), 'problem')} to learn from"
    )
    whole = sorted({p.tag or UNTAGGED for p in learn} - {p.tag or UNTAGGED for p in aside})
    if not whole:
        return note, True
    return (
        f"{note}; task tags with fewer than {least} problems are learned from whole, not gated: {', '.join(whole)}",
        False,
    )


def gate_lines(note: str, decisions: list[GateDecision], library: ExperienceLibrary) -> list[str]:
    """What the library gate did in a run: its note (on, off and why), then, when it measured steps, how many it
    adopted, and when it adopted none, that the run ends with the library it started with."""
    lines = [note] if note else []
    measured = [d for d in decisions if d.verdict != "unchanged"]
    if not measured:
        return lines
    adopted = sum(d.verdict == "adopted" for d in measured)
    lines.append(f"library gate: {adopted} of {counted(len(measured), 'step')} with changes adopted")
    if adopted == 0:
        lines.append(
            f"library gate: no step measured better, so the run ends with the library it started with "
            f"({counted(len(library), 'experience')}), not a worse one"
        )
    return lines


# --- the trial -------------------------------------------------------------------------------------------------
def gate_trial(
    config: RunConfig,
    before: ExperienceLibrary,
    after: ExperienceLibrary,
    problems: Sequence[Problem],
    domain: Domain,
    llm: LLMClient,
    budget: ChecksBudget | None = None,
) -> tuple[SequentialTrial[GateSample, GateDecision], Arm[GateSample]]:
    """The gate as a sequential trial (``tasks.sequential_trial``) and the arm it decides: the library after
    against the library before on every problem set aside, more samples of each at every look (``looks``), the
    two measured in turn so that a look reads what the looks before it drew; judged by ``decide``. The first look
    is always begun; a later one only if it is expected to fit ``budget``, else the gate decides at the look it has,
    saying so; any look stops where its next draw could take the checks past the budget, and the gate decides on
    what it drew, saying so."""
    settings = config.learning.library_gate
    planned = looks(settings)

    def judged(
        arm: Arm[GateSample], before: list[GateSample], after: list[GateSample], look: int, last: bool
    ) -> GateDecision | None:
        return decide(settings, problems, before, after, planned[look - 1])

    def stopped(
        arm: Arm[GateSample], before: list[GateSample], after: list[GateSample], look: int, note: str
    ) -> GateDecision:
        cut = trial.cut
        if cut is not None and cut.look == look:  # this look drawn in part: decided on what it drew
            at = replace(planned[look - 1], stopped=f"look {look} of {len(planned)} {cut.describe()}: {note}")
        else:
            at = replace(planned[look - 2], stopped=f"look {look} of {len(planned)} not drawn: {note}")
        decision = decide(settings, problems, before, after, at)
        assert decision is not None, "a stopped look decides"
        return decision

    trial = SequentialTrial(
        config,
        Stage.LIBRARY_GATE,
        gate_sampling(config),
        domain,
        llm,
        baseline=_arm("before", before),
        looks=[Reach(None, look.k, free=look.number == 1) for look in planned],
        decide=judged,
        stopped=stopped,
        # the gate spends its own reserve: none of it is kept back (a budget ``for_gate`` keeps none already)
        budget=None if budget is None else replace(budget, gate_reserve=0),
        together=False,
    )
    return trial, _arm("after", after, problems)


def _arm(name: str, library: ExperienceLibrary, problems: Sequence[Problem] = ()) -> Arm[GateSample]:
    shown = _whole(library)
    content = shown.content_hash()
    return Arm(name, shown, lambda s: GateSample(**s.model_dump(), arm=name, library_hash=content), problems)


def _whole(library: ExperienceLibrary) -> ExperienceLibrary:
    """The library as a gate problem sees it: whole (a routed library shows every lesson)."""
    return library.with_shown({}) if library.shown is not None else library


def gate_sampling(config: RunConfig) -> Sampling:
    return sampling_at(config, config.learning.library_gate.temperature)


def samples_to_draw(
    config: RunConfig, before: ExperienceLibrary, problems: Sequence[Problem], earlier: Sequence[Sample], domain: Domain
) -> int:
    """The samples the gate of a step starting from ``before`` would draw at all its looks: the library before
    where not drawn already, and the library after (not known yet: all of them)."""
    k = config.learning.library_gate.samples
    seeds = sample_seeds(problems, config.seed)
    known = reusable(earlier)
    return to_draw(problems, _whole(before), k, seeds, gate_sampling(config), domain, known) + len(problems) * k


async def draw_before(
    config: RunConfig,
    before: ExperienceLibrary,
    problems: Sequence[Problem],
    earlier: Sequence[Sample],
    domain: Domain,
    llm: LLMClient,
    allowance: Allowance | None = None,
) -> Measured:
    """The gate's first look at the library before (``earlier``: stored samples, read where their draw keys
    match): it depends on nothing the step computes, so the step draws it beside its rollouts, each request once
    ``allowance`` has room for the most it can cost (the checks budget on the step's tokens so far). The first
    look is always drawn whenever the plan changes the library (what was not drawn here is drawn by the gate);
    where it changes nothing, these samples are stored all the same and the next step's gate, which starts from
    the same library, reads them by their draw keys."""
    k = looks(config.learning.library_gate)[0].k
    seeds = sample_seeds(problems, config.seed)
    known = reusable(earlier)
    return await measure(
        problems, _whole(before), k, seeds, gate_sampling(config), domain, llm,
        stage=Stage.LIBRARY_GATE, known=known.get, judge=make_judge(config, domain, Stage.LIBRARY_GATE),
        count_read=False, allowance=allowance,
    )  # fmt: skip


async def gate_step(
    config: RunConfig,
    before: ExperienceLibrary,
    after: ExperienceLibrary,
    problems: Sequence[Problem],
    earlier: Sequence[Sample],
    domain: Domain,
    llm: LLMClient,
    budget: ChecksBudget | None = None,
    drawn_before: Measured | None = None,
) -> Gate:
    """Attempts of both libraries (``earlier``: stored samples, read where their draw keys match; ``drawn_before``:
    the first look at the library before, drawn beside the step's rollouts) and the decision. A plan that changes
    no lesson needs none (what was drawn before is stored for the next step). ``budget``: a look after the first
    is drawn only if its samples fit (``tasks.checks_budget``); else the gate decides at the look it has, saying
    so."""
    settings = config.learning.library_gate
    if after.content_hash() == before.content_hash():
        drawn = drawn_before or Measured([])
        record = _arm("before", before).record
        samples = [record(s) for s in drawn.samples if s.drawn]  # for the next step to read (those read: stored)
        return Gate(samples, [unchanged(settings, problems, before.content_hash())], drawn.calls)
    trial, arm = gate_trial(config, before, after, problems, domain, llm, budget)
    trial.known.update(reusable(earlier))
    if drawn_before is not None:
        trial.add(trial.baseline, drawn_before)
    await trial.run([arm])
    return Gate(trial.samples, [trial.verdicts[arm.name]], trial.calls)


@stage_task(Stage.LIBRARY_GATE, run_name="library-gate-before-step{step}")
async def gate_before_task(
    config: RunConfig,
    step: int,
    before: LibraryVersion,
    problems: list[Problem],
    earlier: list[GateSample],
    allowance: Allowance | None = None,
) -> Measured:
    """``draw_before`` as a task run of its own (it runs beside the step's rollouts)."""
    library = ExperienceLibrary.from_version(before)
    return await draw_before(config, library, problems, earlier, domain_for(config), shared_client(config), allowance)


@stage_task(Stage.LIBRARY_GATE, run_name="library-gate-step{step}")
async def library_gate_task(
    config: RunConfig,
    step: int,
    before: LibraryVersion,
    after: LibraryVersion,
    problems: list[Problem],
    earlier: list[GateSample],
    budget: ChecksBudget | None = None,
    drawn_before: Measured | None = None,
) -> Gate:
    return await gate_step(
        config,
        ExperienceLibrary.from_version(before),
        ExperienceLibrary.from_version(after),
        problems,
        earlier,
        domain_for(config),
        shared_client(config),
        budget,
        drawn_before,
    )


# --- the decision (the paired comparison: ``clgrpo.reports.metrics.compare``) -----------------------------------------
@dataclass(frozen=True)
class Look:
    """One look of the sequential gate: the samples per problem so far, and the one-sided levels at this look
    (``adopt_alpha`` and ``alpha`` divided by the number of looks: Bonferroni over the looks)."""

    k: int
    adopt_level: float
    worse_level: float
    number: int = 1
    of: int = 1
    stopped: str = ""  # why no later look is drawn (the checks budget): this look decides

    @property
    def last(self) -> bool:
        return self.number == self.of or bool(self.stopped)


def looks(settings: LibraryGate) -> list[Look]:
    """``samples`` per problem in ``looks`` equal parts (the last takes what is left)."""
    count = max(1, min(settings.looks, settings.samples))
    per = -(-settings.samples // count)
    ks = sorted({min(settings.samples, per * i) for i in range(1, count + 1)})
    return [Look(k, settings.adopt_alpha / len(ks), settings.alpha / len(ks), i + 1, len(ks)) for i, k in enumerate(ks)]


def decide(
    settings: LibraryGate,
    problems: Sequence[Problem],
    before: Sequence[GateSample],
    after: Sequence[GateSample],
    look: Look | None = None,
) -> GateDecision | None:
    """The verdict on the pairs so far; None at a look before the last when it neither adopts nor finds a tag
    worse beyond noise (the next look draws more). Without ``look``: one look with every sample."""
    look = look or Look(settings.samples, settings.adopt_alpha, settings.alpha)
    overall = compare([p.problem_id for p in problems], before, after, look.k)
    tags = _tag_rows(settings, problems, before, after, look)
    worse_tags = [t["tag"] for t in tags if t["verdict"] == "worse"]
    numbers = describe_comparison(overall, look.k)
    when = f" at look {look.number} of {look.of}" if look.of > 1 else ""
    if overall.diff is None:
        verdict, why = "rejected", "no attempt could be graded in both arms"
    elif worse_tags:
        verdict, why = "rejected", f"worse beyond noise on tag {', '.join(worse_tags)}{when}"
    elif overall.diff <= settings.min_gain:
        verdict, why = "rejected", f"not better (the mean must rise by more than {settings.min_gain:g})"
    elif settings.rule == "significant" and overall.p_better >= look.adopt_level:
        verdict, why = (
            "rejected",
            f"not better beyond noise (sign test p={overall.p_better:.3f}, not < {look.adopt_level:g})",
        )
    elif settings.rule == "significant":
        verdict, why = (
            "adopted",
            f"better beyond noise{when} (sign test p={overall.p_better:.3f} < {look.adopt_level:g})",
        )
    else:
        verdict, why = "adopted", "better"
    if verdict == "rejected" and not worse_tags and not look.last and overall.diff is not None:
        return None
    return GateDecision(
        verdict=verdict,
        reason=f"library gate: {numbers}: {verdict}, {why}" + (f"; {look.stopped}" if look.stopped else ""),
        rule=settings.rule,
        problem_ids=[p.problem_id for p in problems],
        samples=look.k,
        pairs=overall.pairs,
        before_hash=before[0].library_hash if before else "",
        after_hash=after[0].library_hash if after else "",
        mean_before=overall.mean_before,
        mean_after=overall.mean_after,
        diff=overall.diff,
        ci_low=overall.ci_low,
        ci_high=overall.ci_high,
        better_pairs=overall.better,
        worse_pairs=overall.worse,
        p_better=overall.p_better,
        p_worse=overall.p_worse,
        tags_json=json.dumps(tags),
    )


def _tag_rows(
    settings: LibraryGate,
    problems: Sequence[Problem],
    before: Sequence[GateSample],
    after: Sequence[GateSample],
    look: Look,
) -> list[dict]:
    """Per task tag with at least ``min_problems`` set-aside problems: its comparison and whether it is worse
    beyond noise (the sign test at ``alpha``). Smaller tags are listed as not gated."""
    by_tag: dict[str, list[str]] = defaultdict(list)
    for p in problems:
        if p.tag is not None:
            by_tag[p.tag].append(p.problem_id)
    rows = []
    for tag, ids in sorted(by_tag.items()):
        c = compare(ids, before, after, look.k)
        gated = len(ids) >= settings.min_problems
        verdict = "not_gated" if not gated else "worse" if c.p_worse < look.worse_level else "pass"
        rows.append(
            {
                "tag": tag,
                "problems": len(ids),
                "diff": c.diff,
                "better": c.better,
                "worse": c.worse,
                "p_worse": c.p_worse,
                "verdict": verdict,
            }
        )
    return rows


def describe_comparison(c: Comparison, k: int) -> str:
    """``reward 0.42 -> 0.58 (+0.17, 95% CI [+0.04, +0.29]) on 6 problems x 4 samples (24 pairs: 6 better, 2
    worse; sign test p=0.14)``."""
    if c.diff is None or c.mean_before is None or c.mean_after is None:
        return f"{c.problems} problems x {k} samples, no pair graded in both arms"
    ci = f", 95% CI [{c.ci_low:+.2f}, {c.ci_high:+.2f}]" if c.ci_low is not None and c.ci_high is not None else ""
    p = c.p_better if c.diff >= 0 else c.p_worse
    return (
        f"reward {c.mean_before:.2f} -> {c.mean_after:.2f} ({c.diff:+.2f}{ci}) on {c.problems} problems x {k} "
        f"samples ({c.pairs} pairs: {c.better} better, {c.worse} worse; sign test p={p:.3f})"
    )


def unchanged(settings: LibraryGate, problems: Sequence[Problem], content: str) -> GateDecision:
    return GateDecision(
        verdict="unchanged",
        reason="library gate: the step's plan changes no lesson; nothing to measure",
        rule=settings.rule,
        problem_ids=[p.problem_id for p in problems],
        samples=settings.samples,
        before_hash=content,
        after_hash=content,
    )
