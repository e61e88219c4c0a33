"""The library gate: training problems set aside and never learned from, a step's change adopted only if the
library after it beats the library before it on those problems (paired, same seeds), the verdict stored with its
numbers. The flow tests run the real training flow against the scripted world over HTTP: a misleading lesson
(every attempt shown it is wrong) is kept out by the gate even with lesson validation off; helpful ones pass."""

import json

import pytest
import yaml

from clgrpo.reports.metrics import sign_test
from clgrpo.storage.store import Store
from clgrpo.testing.fake_openai import FakeOpenAIServer
from clgrpo.testing.scripted_llm import FAMILIES, MISLEADING_LESSON, ScriptedWorld, make_problems, write_jsonl
from flows.train import train
from schemas.config import LearningConfig, LibraryGate
from schemas.records import GateSample, Problem
from tasks.library_gate import decide, split_for_gate
from tests.test_lesson_validation import make_config

FAMILY_LESSONS = {f.lesson for f in FAMILIES}


def problem(i: int, tag: str | None = None) -> Problem:
    return Problem(problem_id=f"p{i}", problem=f"q{i}", answer="1", tag=tag)


def test_the_split_is_per_tag_deterministic_and_never_takes_a_whole_tag():
    problems = [problem(i, "a") for i in range(10)] + [problem(i, "b") for i in range(10, 13)] + [problem(13)]
    settings = LibraryGate(enabled=True, share=0.3, min_problems=2)
    learn, aside = split_for_gate(problems, settings, seed=0)
    assert split_for_gate(list(reversed(problems)), settings, seed=0)[1] == list(reversed(aside))  # order-free
    tags = [p.tag for p in aside]
    assert tags.count("a") == 3 and tags.count("b") == 2 and tags.count(None) == 0  # a lone untagged one stays
    assert {p.problem_id for p in learn} | {p.problem_id for p in aside} == {p.problem_id for p in problems}
    assert not {p.problem_id for p in learn} & {p.problem_id for p in aside}
    assert split_for_gate(problems, settings, seed=1)[1] != aside  # another seed, another set


def test_the_sign_test_is_the_exact_binomial_tail():
    assert sign_test(0, 0) == (1.0, 1.0)
    assert sign_test(5, 0) == (1 / 32, 1.0)
    better, worse = sign_test(8, 2)
    assert better == pytest.approx(56 / 1024) and worse == pytest.approx(1013 / 1024)


def samples(arm: str, rewards: dict[str, list[float | None]]) -> list[GateSample]:
    return [
        GateSample(arm=arm, library_hash=arm, problem_id=pid, sample_idx=i, seed=i, reward=r)
        for pid, rs in rewards.items()
        for i, r in enumerate(rs)
    ]


def test_the_decision_adopts_only_a_measured_rise_and_vetoes_a_worse_tag():
    problems = [problem(i, "a") for i in range(4)] + [problem(i, "b") for i in range(4, 8)]
    settings = LibraryGate(enabled=True, samples=2, min_problems=4, rule="better")
    zeros = {f"p{i}": [0.0, 0.0] for i in range(8)}
    better = decide(settings, problems, samples("before", zeros), samples("after", {**zeros, "p0": [1.0, 1.0]}))
    assert better.verdict == "adopted" and (better.better_pairs, better.worse_pairs, better.pairs) == (2, 0, 16)
    assert better.reason.startswith("library gate: reward 0.00 -> 0.12 (+0.12") and better.reason.endswith("better")
    tie = decide(settings, problems, samples("before", zeros), samples("after", zeros))
    assert tie.verdict == "rejected" and "not better" in tie.reason
    # tag b loses every pair while tag a gains more: overall up, but a tag worse beyond noise vetoes it
    ones_b = {**zeros, **{f"p{i}": [1.0, 1.0] for i in range(4, 8)}}
    after = {**{f"p{i}": [1.0, 1.0] for i in range(4)}, **{f"p{i}": [0.0, 0.0] for i in range(4, 8)}}
    mixed = decide(settings, problems, samples("before", ones_b), samples("after", {**after, "p4": [1.0, 1.0]}))
    assert mixed.diff == 0.125 and mixed.verdict == "rejected" and "worse beyond noise on tag b" in mixed.reason
    assert {t["tag"]: t["verdict"] for t in json.loads(mixed.tags_json)} == {"a": "pass", "b": "worse"}
    # the default rule: a rise the sign test calls better at adopt_alpha (0.2), not one inside the noise
    strict = LibraryGate(enabled=True, samples=2, min_problems=4)
    assert strict.rule == "significant" and strict.adopt_alpha == 0.2
    small = decide(strict, problems, samples("before", zeros), samples("after", {**zeros, "p0": [1.0, 1.0]}))
    assert small.verdict == "rejected" and "not better beyond noise (sign test p=0.250, not < 0.2)" in small.reason
    three = decide(
        strict, problems, samples("before", zeros), samples("after", {**zeros, "p0": [1.0, 1.0], "p5": [1.0, 0.0]})
    )
    assert three.verdict == "adopted" and three.reason.endswith("better beyond noise (sign test p=0.125 < 0.2)")


def test_auto_sets_aside_only_where_a_tag_is_large_enough_and_says_off_otherwise():
    settings = LibraryGate(min_problems=4)
    assert settings.enabled == "auto"
    problems = [problem(i, "a") for i in range(10)] + [problem(i, "b") for i in range(10, 17)]
    learn, aside = split_for_gate(problems, settings, seed=0)
    assert {p.tag for p in aside} == {"a"} and len(aside) == 4  # b (7 < 2 x 4) is learned from whole
    assert sum(p.tag == "a" for p in learn) == 6 and sum(p.tag == "b" for p in learn) == 7
    assert split_for_gate(problems[10:], settings, seed=0)[1] == []  # nothing to set aside: the run says so
    assert len(split_for_gate(problems[10:], settings.model_copy(update={"enabled": True}), seed=0)[1]) == 4


def gated_learning(**gate) -> LearningConfig:
    return LearningConfig(
        extract="contrast",
        summarize=False,
        consolidation="passthrough",
        summarize_chunk_size=4,
        library_gate=LibraryGate(enabled=True, samples=4, share=0.25, min_problems=2, **gate),
        examples="off",  # the gate on a step's lessons; worked examples gated: tests/test_examples_flow.py
    )


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_the_gate_keeps_a_misleading_lesson_out_and_lets_the_helpful_ones_in(tmp_path):
    dataset = write_jsonl(make_problems(n_per_family=4, seed=3), tmp_path / "train.jsonl")  # 16 problems
    with FakeOpenAIServer(ScriptedWorld(seed=5, p_base=0.3, p_misleading=1.0)) as server:
        misled = make_config(server, dataset, tmp_path, "misled", gated_learning())
        misled_result = await train(misled)
    with FakeOpenAIServer(ScriptedWorld(seed=5, p_base=0.3, p_misleading=0.0)) as server:
        helped = make_config(server, dataset, tmp_path, "helped", gated_learning())
        helped = helped.model_copy(update={"grpo": helped.grpo.model_copy(update={"epochs": 2})})
        await train(helped)

    with Store(misled.db_path, read_only=True) as store:
        misled_library = store.load_library("misled")
        misled_gate = store.records("library_gates", "misled", 1)[0]
        misled_ops = store.records("operations", "misled", 1)
        rollout_ids = set(store.frame("rollouts", "misled")["problem_id"])
        helped_gates = store.records("library_gates", "helped")
        helped_library = store.load_library("helped")
        helped_samples = store.frame("gate_samples", "helped")
        calls = store.query("SELECT stage, count(*) AS n FROM llm_calls WHERE run_id='helped' GROUP BY stage")

    # the misleading lesson makes every attempt wrong: the step is not adopted, the library stays empty, and every
    # operation is stored as rejected with the gate's numbers
    assert misled_gate.verdict == "rejected" and misled_gate.diff < 0 and misled_gate.worse_pairs > 0
    assert len(misled_library) == 0 and misled_ops
    assert all(r.status.value == "rejected" and r.operation.text == MISLEADING_LESSON for r in misled_ops)
    assert all(r.reason.startswith("library gate: reward ") for r in misled_ops)
    assert misled_result.gate == [
        "library gate: 4 training problems set aside (never trained on), 12 problems to learn from",
        "library gate: 0 of 1 step with changes adopted",
        "library gate: no step measured better, so the run ends with the library it started with (0 experiences), "
        "not a worse one",
    ]
    # the problems set aside are never trained on: no rollout of training shows one
    assert len(misled_gate.problem_ids) == 4 and not set(misled_gate.problem_ids) & rollout_ids

    # the helpful lessons raise the gate's mean: adopted; the second step starts from the first one's library,
    # whose attempts are read back (the second step measures only its own change)
    first, second = helped_gates
    assert first.verdict == "adopted" and first.mean_after > first.mean_before and len(helped_library) > 0
    assert {e.text for e in helped_library} <= FAMILY_LESSONS
    if second.verdict != "unchanged":
        assert second.before_hash == (first.after_hash if first.verdict == "adopted" else first.before_hash)
        step2 = helped_samples[helped_samples["step"] == 2]
        # the library before step 2 was measured in step 1: its samples are read (drawn False), not drawn again
        assert set(step2[step2["drawn"]]["arm"]) == {"after"} and set(step2[~step2["drawn"]]["arm"]) == {"before"}
    assert dict(zip(calls.stage, calls.n))["library_gate"] > 0


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
def test_a_run_says_when_its_gate_is_off_and_why(tmp_path, capsys):
    from application.cli import main

    dataset = write_jsonl(make_problems(n_per_family=1, seed=3)[:3] * 1, tmp_path / "small.jsonl")  # 3 problems
    with FakeOpenAIServer(ScriptedWorld(seed=5)) as server:
        config = tmp_path / "run.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "db_path": str(tmp_path / "runs.duckdb"),
                    "dataset": {"path": str(dataset)},
                    "policy": {"model": "scripted", "base_url": server.base_url, "api_key_env": None},
                    "grpo": {"group_size": 2, "batch_size": 3},
                    "learning": {"summarize": False, "consolidation": "passthrough"},
                }
            )
        )
        assert main(["train", "--config", str(config), "--run-id", "small"]) == 0
        default = capsys.readouterr()
        off = ["train", "--config", str(config), "--run-id", "off", "--set", "learning.library_gate.enabled=false"]
        assert main(off) == 0
        explicit = capsys.readouterr()
    assert (
        "library gate: off for this run: no task tag has 8 training problems (4 to set aside, the rest to learn "
        "from; 3 problems in all)" in default.out
    )
    assert "library gate: off (learning.library_gate.enabled: false)" in explicit.out
    assert "the run's library may answer worse than none" in explicit.out


def test_the_gate_looks_twice_and_stops_at_the_first_clear_verdict():
    from tasks.library_gate import Look, looks

    settings = LibraryGate(samples=4, min_problems=4)  # looks=2: 2 samples per problem, then 2 more
    assert [(x.k, x.adopt_level, x.worse_level, x.last) for x in looks(settings)] == [
        (2, 0.1, 0.025, False),
        (4, 0.1, 0.025, True),
    ]
    assert [x.k for x in looks(LibraryGate(samples=3, looks=2))] == [2, 3]
    assert [x.k for x in looks(LibraryGate(samples=1, looks=3))] == [1]
    problems = [problem(i, "a") for i in range(4)]
    zeros = {f"p{i}": [0.0, 0.0] for i in range(4)}
    first = Look(2, 0.1, 0.025, 1, 2)
    # every pair better at the first look (p = 1/256 < 0.1): adopted without the second
    clear = decide(
        settings, problems, samples("before", zeros), samples("after", {k: [1.0, 1.0] for k in zeros}), first
    )
    assert clear.verdict == "adopted" and "at look 1 of 2" in clear.reason and clear.samples == 2
    # one better pair is not enough yet: undecided, the next look draws more
    assert (
        decide(settings, problems, samples("before", zeros), samples("after", {**zeros, "p0": [1.0, 0.0]}), first)
        is None
    )


def test_the_run_says_which_tags_the_gate_covers():
    from tasks.library_gate import describe_split

    settings = LibraryGate(min_problems=4)
    problems = [problem(i, "a") for i in range(10)] + [problem(i, "b") for i in range(10, 13)]
    learn, aside = split_for_gate(problems, settings, seed=0)
    note, complete = describe_split(settings, learn, aside)
    assert not complete and note == (
        "library gate: 4 training problems set aside (never trained on), 9 problems to learn from; task tags "
        "with fewer than 8 problems are learned from whole, not gated: b"
    )
    learn, aside = split_for_gate(problems[:10], settings, seed=0)
    assert describe_split(settings, learn, aside) == (
        "library gate: 4 training problems set aside (never trained on), 6 problems to learn from",
        True,
    )
    note, complete = describe_split(settings, *split_for_gate(problems[10:], settings, seed=0))
    assert not complete and note.startswith("library gate: off for this run: no task tag has 8 training problems")


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_the_gates_first_look_at_the_library_before_is_drawn_beside_the_rollouts(tmp_path, monkeypatch):
    """The library a step starts from is known when the step starts: the gate's first look at it is drawn while
    the rollouts run (off the step's critical path, issue 60), and the gate decides exactly as when it drew that
    look itself after the step's plan (the same samples, draw keys and decisions)."""
    import flows.train

    dataset = write_jsonl(make_problems(n_per_family=4, seed=3), tmp_path / "train.jsonl")
    runs = {}
    for run_id in ("beside", "after"):
        if run_id == "after":  # the gate draws its first look itself, after the plan
            monkeypatch.setattr(flows.train, "draw_gate_before", lambda *args: None)
        with FakeOpenAIServer(ScriptedWorld(seed=5, p_base=0.3, p_misleading=0.0)) as server:
            # no checks budget: the early draw waits for no rollout's tokens (tests/test_checks_budget.py: with one)
            learning = gated_learning().model_copy(update={"checks_budget": None})
            config = make_config(server, dataset, tmp_path, run_id, learning)
            await train(config.model_copy(update={"grpo": config.grpo.model_copy(update={"epochs": 2})}))
        with Store(config.db_path, read_only=True) as store:
            gates = [g.model_dump(exclude={"run_id", "created_at"}) for g in store.records("library_gates", run_id)]
            samples = store.query(
                "SELECT step, arm, problem_id, sample_idx, draw_key, reward, drawn FROM gate_samples "
                "WHERE run_id = ? ORDER BY ALL",
                [run_id],
            )
            calls = store.query(
                "SELECT stage, min(started_at) AS first, max(started_at) AS last FROM llm_calls "
                "WHERE run_id = ? AND step = 1 GROUP BY stage",
                [run_id],
            ).set_index("stage")
        runs[run_id] = gates, samples, calls
    (gates, samples, calls), (gates_after, samples_after, calls_after) = runs["beside"], runs["after"]
    assert gates == gates_after and len(gates) == 2
    assert samples.equals(samples_after) and samples["drawn"].any()
    # beside: the gate's first call went out before the last rollout; after: once the rollouts were done
    assert calls.loc["library_gate", "first"] < calls.loc["rollout", "last"]
    assert calls_after.loc["library_gate", "first"] > calls_after.loc["rollout", "last"]


async def test_a_first_look_drawn_for_a_step_that_changes_nothing_is_read_by_the_next_step():
    """A step whose plan changes nothing needs no gate, but its first look at the library before was drawn beside
    its rollouts: stored, so the next step, which starts from the same library, reads it instead of drawing it."""
    from clgrpo.experience.library import ExperienceLibrary
    from clgrpo.llm import LLMClient
    from domains.math import MathDomain
    from schemas.config import DatasetConfig, ModelConfig, RunConfig
    from tasks.library_gate import draw_before, gate_step
    from tests.test_sequential_trial import KEY, PROBLEMS, Policy

    policy = Policy()
    with FakeOpenAIServer(policy) as server:
        model = ModelConfig(model="m", base_url=server.base_url, api_key_env=None, max_retries=0)
        gate = LibraryGate(enabled=True, samples=4, looks=2)
        config = RunConfig(dataset=DatasetConfig(path="unused.jsonl"), policy=model,
                           learning=LearningConfig(library_gate=gate))  # fmt: skip
        llm, domain, empty = LLMClient(model), MathDomain(), ExperienceLibrary()
        drawn = await draw_before(config, empty, PROBLEMS, [], domain, llm)
        quiet = await gate_step(config, empty, empty, PROBLEMS, [], domain, llm, drawn_before=drawn)
        assert quiet.library_gates[0].verdict == "unchanged" and len(quiet.gate_samples) == 4 * 2
        assert policy.asked == {"without": 4 * 2}  # the first look: 2 samples of each problem
        helpful = ExperienceLibrary.from_mapping({"G0": KEY})
        next_step = await gate_step(config, empty, helpful, PROBLEMS, quiet.gate_samples, domain, llm)
        await llm.aclose()
    assert next_step.library_gates[0].verdict == "adopted"
    read = [s for s in next_step.gate_samples if s.arm == "before" and not s.drawn]
    assert len(read) == 4 * 2 and policy.asked["without"] == 4 * 2  # read, not drawn again
