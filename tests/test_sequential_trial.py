"""The sequential paired trial that lesson trials and the library gate share (``tasks.sequential_trial``), with a
toy rule against a loopback policy that answers right only when the lesson is in its prompt: an arm decided at
its first look is measured no further while the others go on against the one shared baseline; the checks budget
admits arms in order (the baseline samples they need counted once) and stops a look that does not fit, strictly
(a request goes out only if the most it can cost fits: a trial whose samples cost more stops at its share); known
samples, and a trial's own earlier looks, are read instead of drawn."""

import json
from collections import Counter
from types import SimpleNamespace

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.llm import LLMClient
from clgrpo.reports.metrics import paired_rewards
from clgrpo.testing.fake_openai import ChatRequest, FakeOpenAIServer
from domains.math import MathDomain
from schemas.config import DatasetConfig, ModelConfig, RunConfig
from schemas.records import Problem, Sample
from schemas.stages import Stage
from tasks.checks_budget import ChecksBudget
from tasks.measure import reusable, sampling_at
from tasks.sequential_trial import Arm, Reach, SequentialTrial

KEY = "Count both ends of an inclusive range."
PROBLEMS = [
    Problem(problem_id=f"p{i}", problem=f"How many integers are there in case {i}?", answer="1") for i in range(4)
]


class Policy:
    """Answers 1 (right) when the prompt shows the lesson, else 0; counts the samples asked with and without it."""

    def __init__(self) -> None:
        self.asked: Counter[str] = Counter()

    def __call__(self, request: ChatRequest) -> list[str]:
        shown = KEY in json.dumps(request.messages)
        self.asked["with" if shown else "without"] += request.n
        return [f"The answer is \\boxed{{{int(shown)}}}."] * request.n


def arm(name: str, lesson: str | None, problems: list[Problem] = PROBLEMS) -> Arm[Sample]:
    library = ExperienceLibrary.from_mapping({"G0": lesson}) if lesson else ExperienceLibrary()
    return Arm(name, library, lambda s: s, problems)


def better_everywhere(arm, before, after, look, last):
    """The toy rule: kept when every pair so far is better, rejected at the arm's last look, else undecided."""
    pairs = paired_rewards(before, after)
    if pairs and all(a > b for b, a in pairs):
        return f"kept at look {look} on {len(pairs)} pairs"
    return f"rejected at look {look} on {len(pairs)} pairs" if last else None


def stopped(arm, before, after, look, note):
    return f"stopped at look {look} with {len(after)} samples: {note}"


def trial(
    server, looks, budget=None, together=True, decide=better_everywhere, max_tokens=2048
) -> SequentialTrial[Sample, str]:
    model = ModelConfig(model="m", base_url=server.base_url, api_key_env=None, max_retries=0, max_tokens=max_tokens)
    config = RunConfig(dataset=DatasetConfig(path="unused.jsonl"), policy=model)
    return SequentialTrial(
        config, Stage.VALIDATE_LESSONS, sampling_at(config, None), MathDomain(), LLMClient(model),
        baseline=arm("baseline", None), looks=looks, decide=decide, stopped=stopped, budget=budget, together=together,
    )  # fmt: skip


async def test_an_arm_decided_at_its_first_look_is_measured_no_further_and_the_baseline_is_shared():
    policy = Policy()
    with FakeOpenAIServer(policy) as server:
        t = trial(server, [Reach(2, 2), Reach(4, 2)])
        helpful, neutral = arm("helpful", KEY), arm("neutral", "Read the question twice.")
        await t.run([helpful, neutral])
        await t.llm.aclose()
    assert t.verdicts == {"helpful": "kept at look 1 on 4 pairs", "neutral": "rejected at look 2 on 8 pairs"}
    assert [s.problem_id for s in t.samples_of(helpful)] == ["p0", "p0", "p1", "p1"]  # its first look only
    assert len(t.samples_of(neutral)) == 8 and len(t.samples_of(t.baseline)) == 8  # the baseline drawn once
    assert policy.asked == {"with": 4, "without": 8 + 8} and all(s.drawn for s in t.samples)
    assert len(t.samples) == 20 and len(t.calls) == 10  # one request per problem and arm (n samples)
    assert t.baseline_of(t.samples_of(helpful)) == t.samples_of(t.baseline)[:4]  # its pairs: p0 and p1


def test_the_budget_admits_arms_in_order_counting_the_shared_baseline_once():
    """Before any draw a sample costs the step's rollouts' 100 tokens: the first arm's 4 samples and the 4 of the
    baseline it needs are 800 tokens, the second arm's own 4 another 400 (the baseline is paid for already)."""

    def admitted(allowed: int, names: list[str]) -> tuple[list[str], dict]:
        budget = ChecksBudget.of(1.0, own_tokens=allowed, rollout_tokens=1_000, rollouts=10)
        t = trial(SimpleNamespace(base_url="http://127.0.0.1:9/v1"), [Reach(2, 2)], budget)  # nothing is drawn
        arms = {"helpful": arm("helpful", KEY), "neutral": arm("neutral", "Read the question twice.")}
        return [a.name for a in t.affordable(1, [arms[n] for n in names])], t.verdicts

    assert admitted(1_200, ["helpful", "neutral"]) == (["helpful", "neutral"], {})
    names, verdicts = admitted(1_199, ["helpful", "neutral"])
    assert names == ["helpful"] and list(verdicts) == ["neutral"]
    assert verdicts["neutral"].startswith("stopped at look 1 with 0 samples: the step's checks budget")
    assert admitted(1_199, ["neutral", "helpful"])[0] == ["neutral"]  # in the order given: the one behind stops


async def test_a_look_the_budget_cannot_pay_for_is_not_drawn_and_the_rule_decides_on_what_it_has():
    policy = Policy()
    undecided = lambda arm, before, after, look, last: "rejected at the last look" if last else None  # noqa: E731
    with FakeOpenAIServer(policy) as server:
        # room for nothing: even a free first look (the gate's) is begun only to be stopped before its first request
        t = trial(
            server, [Reach(None, 1, free=True), Reach(None, 2)], ChecksBudget.of(1.0, 1, 1_000, 10), decide=undecided
        )
        await t.run([arm("neutral", "Read the question twice.", PROBLEMS[:2])])
        # a later run (another cluster's next members) draws nothing either: the trial's budget is spent
        await t.run([arm("other", KEY, PROBLEMS[:2])])
        await t.llm.aclose()
    assert not policy.asked and not t.samples and not t.calls
    assert t.cut is not None and t.cut.look == 1 and t.cut.drawn == 0
    for name in ("neutral", "other"):
        assert t.verdicts[name].startswith("stopped at look 1 with 0 samples: the step's checks budget")
        assert "less than its next draw could cost at most" in t.verdicts[name]


class Rambling(Policy):
    """Answers at length: 60 words of thinking before the answer, whatever the prompt."""

    def __call__(self, request: ChatRequest) -> list[str]:
        return ["Thinking it over once more. " * 12 + r for r in super().__call__(request)]


async def test_a_trial_whose_samples_cost_more_than_expected_stops_at_its_share():
    """Priced at the step's rollouts (10 tokens a sample), both arms and their baseline fit 1,000 tokens; drawn,
    each sample costs about 70. Before issue 59 the look ran to its end (about 2,000 tokens); now each request
    is sent only if the most it can cost fits what is left, and the trial stops there."""
    policy = Rambling()
    budget = ChecksBudget.of(1.0, own_tokens=1_000, rollout_tokens=100, rollouts=10)
    with FakeOpenAIServer(policy) as server:
        t = trial(server, [Reach(4, 2)], budget, max_tokens=80)
        arms = [arm("helpful", KEY), arm("neutral", "Read the question twice.")]
        assert t.affordable(1, arms) == arms  # the estimate admits both
        t.verdicts.clear()
        await t.run(arms)
        await t.llm.aclose()
    spent = sum(c.tokens_in + c.tokens_out for c in t.calls)
    assert 0 < spent <= 1_000  # strictly within the budget
    assert t.cut is not None and 0 < t.cut.drawn < t.cut.wanted == 3 * 4 * 2
    assert sum(policy.asked.values()) == t.cut.drawn == len(t.samples)
    assert set(t.verdicts) == {"helpful", "neutral"}  # every arm decided, on what it drew
    free = Rambling()
    with FakeOpenAIServer(free) as server:
        unlimited = trial(server, [Reach(4, 2)], max_tokens=80)
        await unlimited.run([arm("helpful", KEY), arm("neutral", "Read the question twice.")])
        await unlimited.llm.aclose()
    assert sum(c.tokens_in + c.tokens_out for c in unlimited.calls) > 1_000  # what it would have spent


async def test_known_samples_and_a_trials_own_earlier_looks_are_read_not_drawn():
    policy = Policy()
    undecided = lambda arm, before, after, look, last: "rejected at the last look" if last else None  # noqa: E731
    with FakeOpenAIServer(policy) as server:
        first = trial(server, [Reach(2, 2)])
        await first.run([arm("helpful", KEY)])
        assert policy.asked == {"with": 4, "without": 4}
        # another trial from the same library: its baseline is read from the first one's samples
        second = trial(server, [Reach(2, 2)])
        second.known.update(reusable(first.samples))
        await second.run([arm("neutral", "Read the question twice.")])
        assert policy.asked == {"with": 4, "without": 4 + 4}  # only the new arm was drawn
        assert [s.drawn for s in second.samples_of(second.baseline)] == [False] * 4
        assert len(second.calls) == 2
        # in turn, a look that asks more samples of a problem reads what the look before it drew
        policy.asked.clear()
        growing = trial(server, [Reach(None, 1), Reach(None, 2)], together=False, decide=undecided)
        await growing.run([arm("neutral", "Read the question twice.", PROBLEMS[:2])])
        for t in (first, second, growing):
            await t.llm.aclose()
    assert policy.asked == {"without": 2 * 2 + 2 * 2}  # each arm: sample 0 at look 1, sample 1 at look 2
    # both arms, 2 samples of each problem: the latest measurement, not both looks'
    assert Counter(s.problem_id for s in growing.samples) == {"p0": 4, "p1": 4}
    assert all(s.drawn for s in growing.samples)  # sample 0 was read at look 2 but stored as the draw it is
    assert growing.verdicts == {"neutral": "rejected at the last look"}


async def test_an_arm_that_reads_another_arms_draw_keeps_its_own_records():
    """Two libraries can show a problem the same prompt (a worked example is never shown to its own problems, nor
    beyond ``library.examples_shown``): measured in turn, the library after then reads the library before's draw
    for that problem, as a sample of its own arm. It used to take the other arm's record whole (the gate's
    ``one_row_per_sample`` check then refused the step: two rows of arm "before" for one sample)."""
    from schemas.records import Experience, GateSample, WorkedExample

    def gate_arm(name: str, library: ExperienceLibrary) -> Arm[GateSample]:
        content = library.content_hash()
        return Arm(name, library, lambda s: GateSample(**s.model_dump(), arm=name, library_hash=content), PROBLEMS)

    solved = WorkedExample(problem="How many integers are there from 3 to 9?", answer="7", author="m")
    example = Experience(id="E0", text="9 - 3 + 1 = 7. \\boxed{7}", source_groups=[p.problem_id for p in PROBLEMS],
                         example=solved)  # fmt: skip
    policy = Policy()
    with FakeOpenAIServer(policy) as server:
        gate = trial(server, [Reach(None, 2)], together=False, decide=lambda arm, before, after, look, last: "decided")
        gate.baseline = gate_arm("before", ExperienceLibrary())
        after = gate_arm("after", ExperienceLibrary([example]))
        await gate.run([after])
        await gate.llm.aclose()
    assert policy.asked == {"without": 4 * 2}  # one draw per prompt: the library after read the library before's
    rows = Counter((s.arm, s.problem_id, s.sample_idx) for s in gate.samples)
    assert set(rows.values()) == {1} and len(rows) == 2 * 4 * 2  # one row per arm, problem and sample
    assert {s.library_hash for s in gate.samples_of(after)} == {after.library.content_hash()}
    assert all(s.drawn for s in gate.samples_of(gate.baseline)) and not any(s.drawn for s in gate.samples_of(after))


async def test_a_looks_arms_are_drawn_at_once_and_each_prompt_once():
    """The library gate's arms (measured not ``together``: the library after reads the library before's draws) are
    drawn at once at a look, one wave instead of two one after another (issue 60: the checks off the critical
    path); a problem both arms show the same prompt is still drawn once, for the arm before."""
    policy = Policy()
    slow = lambda request: 0.3  # noqa: E731
    with FakeOpenAIServer(policy, latency=slow) as server:
        gate = trial(server, [Reach(None, 2)], together=False, decide=lambda arm, before, after, look, last: "decided")
        partly = arm("partly", KEY, PROBLEMS)
        # the library after shows the lesson to every problem; another arm shows it none: the baseline's prompts
        shared = arm("same as before", None, PROBLEMS[:2])
        await gate.run([partly, shared])
        await gate.llm.aclose()
    # one request of 2 samples per problem: 4 for the library before and 4 for the lesson's arm, all in flight at
    # once; the arm that shows the baseline's prompts drew nothing
    assert server.stats.max_in_flight == 8 and server.stats.chat_requests == 8
    assert policy.asked == {"with": 4 * 2, "without": 4 * 2}
    assert not any(s.drawn for s in gate.samples_of(shared)) and len(gate.samples_of(shared)) == 2 * 2
