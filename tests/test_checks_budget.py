"""The checks budget (``learning.checks_budget``): a step's lesson trials and library gate spend at most that
multiple of the step's own tokens (rollouts and learner calls). The flow tests run the real training flow against
the scripted world over HTTP, once without a limit (to show the limit binds) and once with it."""

import re

import pytest

from clgrpo.prompts.rollout import LIBRARY_TEMPLATE
from clgrpo.storage.store import Store
from clgrpo.testing.fake_openai import ChatRequest, FakeOpenAIServer, message_text, role_of
from clgrpo.testing.scripted_llm import ScriptedWorld, make_problems, write_jsonl
from flows.step import OWN_STAGES
from flows.train import train
from schemas.config import LearningConfig, LessonValidation, LibraryGate, RunConfig
from schemas.records import GateSample, Problem
from tasks.checks_budget import RESERVE_MARGIN, ChecksBudget, added_prompt
from tasks.library_gate import decide, looks
from tests.test_lesson_validation import make_config

CHECKS = ("validate_lessons", "library_gate")


def checked_learning(budget: float | None) -> LearningConfig:
    return LearningConfig(
        extract="contrast",
        candidates=2,
        summarize=False,
        consolidation="passthrough",
        summarize_chunk_size=4,
        lesson_validation=LessonValidation(enabled=True, samples=4, problems=2),
        library_gate=LibraryGate(enabled=True, samples=4, share=0.25, min_problems=2),
        checks_budget=budget,
    )


def spent(store: Store, run_id: str) -> tuple[int, int]:
    """(the step's own tokens, its checks' tokens) of step 1."""
    rows = store.query(
        "SELECT stage, sum(tokens_in + tokens_out) AS t FROM llm_calls WHERE run_id = ? AND step = 1 GROUP BY stage",
        [run_id],
    )
    by_stage = dict(zip(rows.stage, rows.t))
    return sum(int(by_stage.get(s, 0)) for s in OWN_STAGES), sum(int(by_stage.get(s, 0)) for s in CHECKS)


class LongWinded(ScriptedWorld):
    """The scripted world whose policy, shown a lesson, thinks aloud at length before it answers (about 150 words,
    of 256 tokens at most): a trial's samples cost several times the step's rollouts (shown none at step 1), so
    priced at the rollouts' tokens, trials are admitted whose samples overrun their share."""

    def __call__(self, request: ChatRequest) -> list:
        replies = super().__call__(request)
        shown = LIBRARY_HEADER in "\n".join(message_text(m) for m in request.messages)
        if role_of(request) != "policy" or not shown:
            return replies
        return [THINKING + r if isinstance(r, str) else r for r in replies]


LIBRARY_HEADER = LIBRARY_TEMPLATE.split("{library}")[0].strip()
THINKING = "Let me think about this carefully before I answer. " * 15


async def run(tmp_path, run_id: str, budget: float | None, world: type[ScriptedWorld] = ScriptedWorld) -> RunConfig:
    dataset = write_jsonl(make_problems(n_per_family=4, seed=3), tmp_path / "train.jsonl")
    with FakeOpenAIServer(world(seed=5, p_base=0.3, p_misleading=0.5)) as server:
        cfg = make_config(server, dataset, tmp_path, run_id, checked_learning(budget))
        await train(cfg)
    return cfg


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_a_steps_checks_stay_within_their_budget_and_say_what_it_cut(tmp_path):
    """Issue 59: priced at the step's rollouts' tokens, trials are admitted whose samples (shown a lesson, the
    policy thinks aloud) cost several times more; before, they ran to the end and the checks overran the budget.
    Each request now goes out only if the most it can cost fits: the trials stop at their share, strictly."""
    await run(tmp_path, "free", None, LongWinded)  # the same run without a limit
    bounded = await run(tmp_path, "bounded", 0.75, LongWinded)
    with Store(bounded.db_path, read_only=True) as store:
        own_free, checks_free = spent(store, "free")
        own, checks = spent(store, "bounded")
        trial_tokens = int(
            store.query(
                "SELECT sum(tokens_in + tokens_out) AS t FROM llm_calls WHERE run_id = 'bounded' AND step = 1 "
                "AND stage = 'validate_lessons'"
            )["t"].iloc[0]
        )
        trials = store.records("lesson_trials", "bounded", 1)
        operations = store.records("operations", "bounded", 1)
        gate = store.records("library_gates", "bounded", 1)
    # without a limit the checks spend more than 0.75 times the step's own tokens: the limit below binds
    assert checks_free > 0.75 * own_free
    # with it they stay within it, strictly, and the trials within their share (the gate's reserve kept)
    assert 0 < checks <= 0.75 * own, (checks, own)
    # the reserve as a trial the budget cut names it (the last trial may be a worked example's: the gate tries it)
    kept_for_gate = re.compile(r"([\d,]+) of them kept for the library gate")
    reserve = int(next(m for t in trials if (m := kept_for_gate.search(t.reason))).group(1).replace(",", ""))
    assert trial_tokens <= int(0.75 * own) - reserve
    # a trial admitted at the estimate was stopped at the share and decided on what it drew; the rest not tried
    stopped = [t for t in trials if "drawn in part" in t.reason]
    assert stopped and all("less than its next draw could cost at most" in t.reason for t in stopped)
    untried = [
        t for t in trials if t.reason.startswith("not tried: the step's checks budget (learning.checks_budget=0.75: ")
    ]
    assert untried and all(t.verdict == "rejected" for t in untried)
    # what the budget cut is never applied, and the operations say why
    untried_texts = {t.operation.text for t in untried}
    assert all(r.status.value == "rejected" for r in operations if r.operation.text in untried_texts)
    assert any("checks budget" in r.reason for r in operations)
    assert gate, "the gate still measured the step"


def sample(arm: str, pid: str, idx: int, reward: float) -> GateSample:
    return GateSample(
        arm=arm,
        library_hash=arm,
        problem_id=pid,
        sample_idx=idx,
        seed=idx,
        reward=reward,
    )


def test_a_gate_look_the_budget_cannot_pay_for_is_not_drawn_and_the_decision_says_so():
    from dataclasses import replace

    settings = LibraryGate(samples=4, min_problems=2)
    problems = [Problem(problem_id=f"p{i}", problem=f"q{i}", answer="1", tag="a") for i in range(4)]
    first = looks(settings)[0]
    before = [sample("before", p.problem_id, i, 0.0) for p in problems for i in range(2)]
    after = [sample("after", p.problem_id, i, float(p.problem_id == "p0")) for p in problems for i in range(2)]
    assert decide(settings, problems, before, after, first) is None  # undecided: a second look would be drawn
    stopped = decide(settings, problems, before, after, replace(first, stopped="look 2 of 2 not drawn: X"))
    assert stopped is not None and stopped.verdict == "rejected" and stopped.samples == 2
    assert stopped.reason.endswith("; look 2 of 2 not drawn: X")


def test_the_budget_reserves_the_gate_first_and_counts_what_was_spent():
    budget = ChecksBudget.of(1.0, own_tokens=10_000, rollout_tokens=8_000, rollouts=40, gate_samples=16)
    assert budget.allowed == 10_000 and budget.per_sample == 200
    assert budget.gate_reserve == round(16 * 200 * RESERVE_MARGIN)
    assert budget.left() == 10_000 - budget.gate_reserve
    assert budget.fits(10, 200, spent_here=budget.left() - 2_000) and not budget.fits(11, 200, budget.left() - 2_000)
    gate = budget.after(500).for_gate(3_000)
    assert gate.left(reserve=False) == 10_000 - 3_500 and gate.gate_reserve == 0
    assert "learning.checks_budget=1: 10,000 tokens" in gate.describe(reserve=False)
    # the trials cannot spend the reserve (tasks.checks_budget.Allowance): the gate has what is left, and no more
    rest = budget.after(500).for_gate(budget.left() - 500)
    assert rest.left(reserve=False) == budget.gate_reserve == 4_000
    assert rest.left(3_000, reserve=False) == 1_000 and not rest.fits(6, 200, 3_000, reserve=False)
    assert budget.after(500).for_gate(7_000).left(reserve=False) == 2_500  # (calls around the trials): strictly
    unlimited = ChecksBudget.of(None, 10_000, 8_000, 40, 16)
    assert unlimited.fits(10**9, 1.0)
    # the gate's own samples drawn beside the rollouts cost more each (the whole library in every prompt, fewer
    # samples a request): its reserve is priced at them (the demo's look 2 went undrawn at the rollouts' price)
    dearer = ChecksBudget.of(1.0, 10_000, 8_000, 40, gate_samples=16, gate_per_sample=300)
    assert dearer.gate_reserve == round(16 * 300 * RESERVE_MARGIN) and dearer.per_sample == 200
    assert ChecksBudget.of(1.0, 10_000, 8_000, 40, 16, gate_per_sample=150).gate_reserve == budget.gate_reserve
    # the library after's samples show the step's candidates too: their prompts are priced with them
    shown = ChecksBudget.of(1.0, 10_000, 8_000, 40, gate_samples=16, after_samples=8, after_prompt=250)
    assert shown.gate_reserve == round((16 * 200 + 8 * 250) * RESERVE_MARGIN)


def test_what_a_plan_adds_to_a_prompt_is_its_longest_lesson_and_its_longest_shown_examples():
    from schemas.records import Operation, OpKind, WorkedExample

    def example(words: int) -> Operation:
        shown = WorkedExample(problem="How many?", answer="7", author="m", reward=1.0, origin="rollout")
        return Operation(op=OpKind.ADD, text=" ".join(["w"] * words), example=shown)

    lesson = Operation(op=OpKind.ADD, text="Count both ends: last - first + 1.")
    dropped = Operation(op=OpKind.DELETE, target_ids=["e1"])
    plan = [lesson, example(10), example(50), Operation(op=OpKind.ADD, text="Shorter."), example(30), dropped]
    assert added_prompt(plan, examples_shown=2) == 10 + (3 + 50) + (3 + 30)  # "How many?": 3 estimated tokens
    assert added_prompt(plan, examples_shown=0) == 10 and added_prompt([], 2) == 0


def test_the_gate_draws_a_further_look_only_if_its_samples_fit(tmp_path):
    from types import SimpleNamespace

    from clgrpo.experience.library import ExperienceLibrary
    from domains import domain_for
    from tasks.library_gate import gate_trial

    server = SimpleNamespace(base_url="http://127.0.0.1:9/v1")
    cfg = make_config(server, tmp_path / "d.jsonl", tmp_path, "r", checked_learning(1.0))  # type: ignore[arg-type]
    problems = [Problem(problem_id=f"p{i}", problem=f"q{i}", answer="1", tag="a") for i in range(4)]
    before = ExperienceLibrary()
    after = ExperienceLibrary.from_mapping({"G0": "Count both ends of an inclusive range."})

    def second_look(budget: ChecksBudget) -> str | None:
        """Why the second look (4 samples per problem: 2 more of each arm, 32 to draw) is not drawn, or None."""
        trial, arm = gate_trial(cfg, before, after, problems, domain_for(cfg), None, budget)  # type: ignore[arg-type]
        assert [x.samples for x in trial.looks] == [2, 4] and trial.looks[0].free and not trial.looks[1].free
        if trial.affordable(2, [arm]) == [arm]:
            return None
        return trial.verdicts[arm.name].reason

    # 32 samples at 100 tokens: 3,200 tokens; 5,000 allowed, 1,000 spent by the trials
    assert second_look(ChecksBudget.of(1.0, 5_000, 1_000, 10).for_gate(1_000)) is None
    why = second_look(ChecksBudget.of(1.0, 5_000, 1_000, 10).for_gate(2_000))
    assert why is not None and "; look 2 of 2 not drawn: the step's checks budget" in why
    # what is left is all the gate has, its reserve included (4,000 for the 32 samples): 1,000 left, not drawn
    assert second_look(ChecksBudget.of(1.0, 5_000, 1_000, 10, gate_samples=32).for_gate(4_000)) is not None


@pytest.mark.parametrize("order, first", [("plan", 0), ("support", 2)])
def test_the_budget_admits_candidates_in_the_order_the_setting_says(tmp_path, order, first):
    """With room for one candidate's attempts, ``plan`` tries the plan's first candidate and ``support`` the one
    more groups proposed; the other is rejected untried, naming the budget."""
    from types import SimpleNamespace

    from clgrpo.experience.library import ExperienceLibrary
    from domains import domain_for
    from schemas.records import Operation, OpKind
    from tasks.trial_choice import Candidate
    from tasks.validate_lessons import LessonTrials

    server = SimpleNamespace(base_url="http://127.0.0.1:9/v1")
    learning = checked_learning(1.0).model_copy(
        update={"lesson_validation": LessonValidation(enabled=True, samples=4, problems=1, order=order)}
    )
    cfg = make_config(server, tmp_path / "d.jsonl", tmp_path, "r", learning)  # type: ignore[arg-type]
    problem = Problem(problem_id="p0", problem="q0", answer="1", tag="a")
    library = ExperienceLibrary()

    def candidate(seq: int, text: str, groups: list[str]) -> Candidate:
        op = Operation(op=OpKind.ADD, text=text, source_groups=groups)
        return Candidate(seq, op, ExperienceLibrary.from_mapping({"G0": text}), [problem])

    candidates = [
        candidate(0, "Read the question twice before you start.", ["g1"]),
        candidate(2, "Count both ends of an inclusive range.", ["g1", "g2", "g3"]),
    ]
    # one candidate's 4 attempts and the 4 baseline attempts at 100 tokens: 800 of the 1,000 left
    budget = ChecksBudget.of(1.0, own_tokens=1_000, rollout_tokens=1_000, rollouts=10)
    lessons = LessonTrials(cfg, library, domain_for(cfg), None, budget)  # type: ignore[arg-type]  # nothing drawn
    admitted = lessons.trial.affordable(1, [lessons.arm(c) for c in candidates])
    assert [a.name for a in admitted] == [first]
    (cut,) = lessons.decided.values()
    assert cut.seq != first and cut.verdict == "rejected" and "checks budget" in cut.reason


async def test_an_early_draw_sends_a_request_once_the_steps_tokens_make_room_and_never_after_it_closes():
    """The gate's first look drawn beside the rollouts (issue 60) follows the step's own tokens as they come in:
    a request waits until the budget on them has room for the most it can cost; once the gate takes the draw
    over, a request still waiting is not sent (the gate draws its samples under its own allowance)."""
    import asyncio

    from tasks.checks_budget import GrowingAllowance

    allowance = GrowingAllowance()
    first = asyncio.create_task(allowance.reserve(100, 50, 2))  # at most 200 tokens
    second = asyncio.create_task(allowance.reserve(100, 50, 2))
    await asyncio.sleep(0.01)
    assert not first.done()  # nothing spent by the step yet: no room
    await allowance.grow(250)
    assert await first == 2 and not second.done()  # 200 held: the second waits for room
    await allowance.settle(200, 120)  # it cost 120: 130 free, still short of 200
    await asyncio.sleep(0.01)
    assert not second.done()
    await allowance.close()
    assert await second == 0 and await allowance.reserve(1, 1, 1) == 0  # never sent
