"""Contrast extraction and lesson validation: a group's candidates are tried on their problems without and
with them before anything is applied; helpful lessons are kept with their numbers, misleading ones rejected
with theirs. The flow tests run the real training flow against the scripted world over HTTP."""

import json

import pytest
from pydantic import ValidationError

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.storage.store import Store
from clgrpo.testing.fake_openai import FakeOpenAIServer
from clgrpo.testing.scripted_llm import FAMILIES, MISLEADING_LESSON, ScriptedWorld, make_problems, write_jsonl
from flows.train import train
from schemas.config import DatasetConfig, GRPOConfig, LearningConfig, LessonValidation, ModelConfig, RunConfig
from schemas.records import LessonTrial, Operation, OpKind, TrialSample
from tasks.plan import plan_after
from tasks.trial_choice import Candidate
from tasks.validate_lessons import best_per_group, judge_trial

FAMILY_LESSONS = {f.lesson for f in FAMILIES}


def contrast_learning(**validation) -> LearningConfig:
    return LearningConfig(
        extract="contrast",
        candidates=2,
        summarize=False,
        consolidation="passthrough",
        summarize_chunk_size=4,
        lesson_validation=LessonValidation(**{"enabled": True, "samples": 4, "problems": 2, **validation}),
        checks_budget=None,  # every candidate tried: the budget is tests/test_checks_budget.py's
        examples="off",  # the trials of lessons; a worked example's trial is tests/test_examples_flow.py's
    )


def make_config(server: FakeOpenAIServer, dataset, tmp_path, run_id: str, learning: LearningConfig) -> RunConfig:
    model = ModelConfig(
        model="scripted",
        base_url=server.base_url,
        api_key_env=None,
        max_tokens=256,
        retry_base_delay_s=0.01,
        retry_max_delay_s=0.05,
        timeout_s=10,
        seed=11,
    )
    return RunConfig(
        run_id=run_id,
        db_path=str(tmp_path / "runs.duckdb"),
        dataset=DatasetConfig(path=str(dataset), seed=1),
        policy=model,
        grpo=GRPOConfig(group_size=4, epochs=1, batch_size=16, rollout_chunk_size=8),
        learning=learning,
        concurrency=8,
        pipeline=False,
    )


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_validation_keeps_the_helpful_candidates_and_rejects_the_misleading_ones(tmp_path):
    dataset = write_jsonl(make_problems(n_per_family=4, seed=3), tmp_path / "train.jsonl")
    world = ScriptedWorld(seed=5, p_base=0.3, p_misleading=0.5)
    with FakeOpenAIServer(world) as server:
        cfg = make_config(server, dataset, tmp_path, "validated", contrast_learning())
        result = await train(cfg)

    assert world.stats.by_role["experience extractor (contrast)"] > 0
    with Store(cfg.db_path, read_only=True) as store:
        library = store.load_library("validated")
        trials = store.records("lesson_trials", "validated", 1)
        samples = store.records("trial_samples", "validated", 1)
        rollouts = store.records("rollouts", "validated", 1)
        operations = store.records("operations", "validated", 1)
        proposals = store.records("proposals", "validated", 1, "group_advantage")
        summaries = store.records("summaries", "validated", 1)
        calls = store.query("SELECT stage, count(*) AS n FROM llm_calls WHERE run_id='validated' GROUP BY stage")
        stages = set(store.query("SELECT stage FROM stage_runs WHERE run_id='validated' AND step=1")["stage"])
        replies = store.query("SELECT reply FROM llm_calls WHERE run_id='validated' AND role='learner' AND ok")

    # every candidate of every group was proposed, every reply kept with the attempts it compared
    assert all(len(json.loads(p.raw_text)) == 2 for p in proposals if p.raw_text)
    assert all(
        "attempts" in entry and "reply" in entry for p in proposals if p.raw_text for entry in json.loads(p.raw_text)
    )
    assert len(replies) > 0 and replies["reply"].notna().all()  # and every learner reply is in its call's row
    misleading = [t for t in trials if t.operation.text == MISLEADING_LESSON]
    helpful = [t for t in trials if t.operation.text in FAMILY_LESSONS]
    assert misleading and helpful
    # the misleading lesson makes every attempt wrong: never kept, rejected with its numbers
    assert all(t.verdict == "rejected" and t.gain is not None and t.gain <= 0 for t in misleading)
    rejected = {r.operation.text: r.reason for r in operations if r.status.value == "rejected"}
    assert rejected[MISLEADING_LESSON].startswith("lesson validation: reward ") and "->" in rejected[MISLEADING_LESSON]
    # what was applied is the family lessons, each with its validation numbers, at most one per group
    applied = [r for r in operations if r.status.value == "applied"]
    assert applied and {r.operation.text for r in applied} <= FAMILY_LESSONS
    assert all("[validated: reward " in r.operation.rationale for r in applied)
    assert {e.text for e in library} == {r.operation.text for r in applied}
    kept = [t for t in trials if t.verdict == "kept"]
    groups = [g for t in kept for g in t.operation.source_groups]
    assert len(groups) == len(set(groups)) and all(t.gain > 0 and t.mean_with > t.mean_without for t in kept)
    # the attempts: a shared baseline (seq -1) and one arm per tried candidate, on the same seeds
    tried = {t.seq for t in trials if t.verdict != "untested"}
    assert {s.seq for s in samples} == tried | {-1}
    baseline = {(s.problem_id, s.sample_idx): s.seed for s in samples if s.seq == -1}
    assert all(baseline[(s.problem_id, s.sample_idx)] == s.seed for s in samples)
    # the baseline is the step's own rollouts (the same prompt and temperature): read, never drawn again
    rolled = {(r.problem_id, r.sample_idx) for r in rollouts}
    assert baseline and all(not s.drawn and (s.problem_id, s.sample_idx) in rolled for s in samples if s.seq == -1)
    assert all(s.drawn for s in samples if s.seq != -1)
    # summaries off: the stage ran and stored nothing; validation is a stage of its own, its calls counted
    assert not summaries and {"summarize", "validate_lessons"} <= stages
    by_stage = dict(zip(calls.stage, calls.n))
    assert by_stage["validate_lessons"] > 0 and "summarize" not in by_stage
    assert result.steps[0].operations_rejected >= len(misleading)


def test_candidates_need_validation():
    with pytest.raises(ValidationError, match="lesson_validation.enabled"):
        LearningConfig(candidates=3)
    assert LearningConfig(candidates=3, lesson_validation=LessonValidation(enabled=True)).candidates == 3


def _samples(seq: int, rewards: list[float | None]) -> list[TrialSample]:
    return [
        TrialSample(seq=seq, problem_id=f"p{i // 2}", sample_idx=i % 2, seed=100 + i, reward=r)
        for i, r in enumerate(rewards)
    ]


def _candidate(seq: int, groups: list[str]) -> Candidate:
    op = Operation(op=OpKind.ADD, text=f"lesson {seq}", source_groups=groups)
    return Candidate(seq, op, None, [])  # type: ignore[arg-type]


def test_the_verdict_is_paired_and_ties_go_against_the_lesson():
    settings = LessonValidation(enabled=True, samples=2)
    without = _samples(-1, [0.0, 1.0, 0.0, None])
    better = judge_trial(_candidate(0, ["g"]), without, _samples(0, [1.0, 1.0, 0.0, 1.0]), settings)
    assert (better.verdict, better.pairs, better.mean_without, better.mean_with) == ("kept", 3, 1 / 3, 2 / 3)
    assert better.reason.startswith("validated: reward 0.33 -> 0.67 (+0.33)")
    same = judge_trial(_candidate(1, ["g"]), without, _samples(1, [1.0, 0.0, 0.0, 1.0]), settings)
    assert same.verdict == "rejected" and "not above learning.lesson_validation.min_gain=0" in same.reason
    ungraded = judge_trial(_candidate(2, ["g"]), without, _samples(2, [None, None, None, None]), settings)
    assert ungraded.verdict == "rejected" and "no attempt could be graded" in ungraded.reason


def test_only_the_best_candidate_of_a_group_goes_on():
    def trial(seq: int, groups: list[str], gain: float, verdict: str = "kept") -> LessonTrial:
        op = Operation(op=OpKind.ADD, text=f"lesson {seq}", source_groups=groups)
        return LessonTrial(seq=seq, operation=op, gain=gain, verdict=verdict, reason="validated: ...")

    trials = best_per_group(
        [
            trial(0, ["a"], 0.25),
            trial(1, ["a"], 0.5),
            trial(2, ["b"], 0.25),
            trial(3, ["b"], -0.25, "rejected"),
            LessonTrial(
                seq=4,
                operation=Operation(op=OpKind.DELETE, target_ids=["E0"]),
                verdict="untested",
                reason="delete operations are not validated",
            ),
        ]
    )
    assert [t.verdict for t in trials] == ["rejected", "kept", "kept", "rejected", "untested"]
    assert 'another candidate of group a gained more ("lesson 1": +0.50 against +0.25)' in trials[0].reason
    tie = best_per_group([trial(0, ["c"], 0.25), trial(1, ["c"], 0.25)])
    assert [t.verdict for t in tie] == ["kept", "rejected"]
    assert 'gained as much and comes first in the plan ("lesson 0": +0.25 against +0.25)' in tie[1].reason
    plan, rejected = plan_after(trials)
    assert [op.text for op in plan] == ["lesson 1", "lesson 2", None]
    assert plan[0].rationale.endswith("[validated: ...]") and len(rejected) == 2


def test_a_lesson_naming_its_problems_numbers_is_not_general():
    from domains.learner import problem_numbers

    problem = "The seats in a row are numbered 50 through 79. How many seats are in the row?"
    assert problem_numbers("Subtract 50 from 79 and add 1.", problem) == ["50", "79"]
    assert problem_numbers("Subtract the first seat number from the last and add 1.", problem) == []
    assert problem_numbers("Use 5 and 7.", "Pick 5 of 7 cards.") == ["5", "7"]
    assert problem_numbers("Add 1 to the difference.", "Count from 1 to 9.") == []


async def test_a_candidate_about_its_own_problem_is_rewritten_and_both_replies_are_kept():
    from clgrpo.llm import LLMClient
    from domains.learner import LearnerPrompts
    from schemas.records import Problem, Reward, Rollout, Turn
    from tasks.group_advantage import Group, extract_group_advantage

    general = "When both ends of a range count, subtract the first number from the last and add one."

    def learner(request):
        if request.messages[-1]["content"].startswith("A lesson drafted from the problem above"):
            return [json.dumps({"lesson": general})]
        return [json.dumps({"difference": "It added one.", "lesson": "Seats 50 through 79 make 79 - 50 + 1 seats."})]

    problem = Problem(
        problem_id="p1", problem="The seats in a row are numbered 50 through 79. How many seats?", answer="30"
    )
    rollouts = [
        Rollout(
            problem_id="p1",
            sample_idx=i,
            prompt_hash="h",
            library_version=0,
            turns=[Turn(kind="assistant", content=f"79 - 50 {'+ 1 ' if i == 0 else ''}= \\boxed{{{a}}}")],
        )
        for i, a in enumerate((30, 29))
    ]
    rewards = [Reward(problem_id="p1", sample_idx=0, reward=1.0), Reward(problem_id="p1", sample_idx=1, reward=0.0)]
    cfg = LearningConfig(extract="contrast", candidates=1, min_words=6, max_words=30)
    with FakeOpenAIServer(learner) as server:
        client = LLMClient(ModelConfig(model="m", base_url=server.base_url, api_key_env=None, max_retries=0))
        batch = await extract_group_advantage(
            [Group(problem, rollouts, rewards)], [], ExperienceLibrary(), LearnerPrompts(), client, cfg
        )
        await client.aclose()
    proposal = batch.proposals[0]
    assert [op.text for op in proposal.operations] == [general]
    assert (
        "[rewritten as a general lesson: the draft copied from training problem p1]" in proposal.operations[0].rationale
    )
    record = json.loads(proposal.raw_text)[0]
    assert record["generalized"]["draft"].startswith("Seats 50 through 79") and len(batch.llm_calls) == 2


def test_trials_on_others_skip_the_sources_and_stay_within_the_tag():
    from schemas.records import GroupAdvantage, Problem
    from tasks.trial_choice import trial_problems

    def p(i: int, tag: str) -> Problem:
        return Problem(problem_id=f"p{i}", problem=f"q{i}", answer="1", tag=tag)

    step = [p(0, "a"), p(1, "a"), p(2, "a"), p(3, "b")]
    pool = [*step, p(4, "a"), p(5, "a"), p(6, "b")]
    mixed = [
        GroupAdvantage(
            problem_id="p2", rewards=[0.0, 1.0], mean_reward=0.5, std_reward=0.5, advantages=[-1.0, 1.0],
            selected=True, reason="mixed rewards",
        )
    ]  # fmt: skip
    op = Operation(op=OpKind.ADD, text="t", source_groups=["p0"])
    chosen = [x.problem_id for x in trial_problems(op, step, mixed, 10, "s", pool, others_only=True)]
    assert chosen[:2] == ["p2", "p1"] and set(chosen[2:]) == {"p4", "p5"}  # the step's mixed first; no p0, no b
    assert [x.problem_id for x in trial_problems(op, step, mixed, 2, "s")][0] == "p0"  # sources first (default)


def test_the_sequential_sign_test_keeps_rejects_or_waits():
    settings = LessonValidation(enabled=True, samples=2, test="sign", problems=2, max_problems=6, alpha=0.05)
    assert settings.looks == 3  # level 0.05 / 3 per look

    def pairs(before: list[float], after: list[float]):
        return _samples(-1, before), _samples(0, after)

    strong = judge_trial(_candidate(0, ["g"]), *pairs([0.0] * 8, [1.0] * 8), settings, last_look=False)
    assert strong.verdict == "kept" and "8 better, 0 worse; sign test p=0.004" in strong.reason
    weak = judge_trial(_candidate(0, ["g"]), *pairs([0.0] * 4, [1.0, 0.0, 0.0, 0.0]), settings, last_look=False)
    assert weak is None  # one better pair decides nothing: another look
    tie = judge_trial(_candidate(0, ["g"]), *pairs([0.0] * 4, [1.0, 0.0, 0.0, 0.0]), settings, last_look=True)
    assert tie.verdict == "rejected" and tie.reason.endswith(": no effect")
    harmful = judge_trial(_candidate(0, ["g"]), *pairs([1.0] * 8, [0.0] * 8), settings, last_look=False)
    assert harmful.verdict == "rejected" and harmful.reason.endswith(": worse")


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_sequential_trials_on_other_problems_keep_the_helpful_lessons(tmp_path):
    rows = [{**row, "tag": row["id"].split("-")[0]} for row in make_problems(n_per_family=5, seed=3)]  # the family
    dataset = write_jsonl(rows, tmp_path / "train.jsonl")
    world = ScriptedWorld(seed=5, p_base=0.2, p_misleading=0.5)
    learning = contrast_learning(trials_on="others", test="sign", problems=2, max_problems=4)
    with FakeOpenAIServer(world) as server:
        cfg = make_config(server, dataset, tmp_path, "sequential", learning)
        await train(cfg)
    with Store(cfg.db_path, read_only=True) as store:
        trials = store.records("lesson_trials", "sequential", 1)
    tried = [t for t in trials if t.verdict != "untested" and "same lesson" not in t.reason]
    assert tried and all(set(t.problem_ids).isdisjoint(t.operation.source_groups) for t in tried)
    family = {row["id"]: row["tag"] for row in rows}  # tried only on other problems of the sources' family
    assert all({family[p] for p in t.problem_ids} <= {family[g] for g in t.operation.source_groups} for t in tried)
    kept = [t for t in tried if t.verdict == "kept"]
    assert kept and all(t.operation.text in FAMILY_LESSONS and "sign test p=" in t.reason for t in kept)
    assert all(t.verdict == "rejected" for t in tried if t.operation.text == MISLEADING_LESSON)


def test_the_rater_breaks_ties_for_the_specific_lesson_and_reads_its_reply():
    from tasks.specificity import parse_rating

    def trial(seq: int, gain: float, text: str) -> LessonTrial:
        op = Operation(op=OpKind.ADD, text=text, source_groups=["g"])
        return LessonTrial(seq=seq, operation=op, gain=gain, verdict="kept", reason="validated: ...")

    tied = [trial(0, 0.25, "Always check your work."), trial(1, 0.25, "Count both ends: last - first + 1.")]
    assert [t.verdict for t in best_per_group(tied)] == ["kept", "rejected"]  # no rating: the first in the plan
    rated = best_per_group(tied, specific={1})
    assert [t.verdict for t in rated] == ["rejected", "kept"]
    assert "gained as much with a specific lesson (the lesson rater)" in rated[0].reason
    # 1.00 - 0.67 and 0.67 - 0.33 differ in the last bit (seen on `ranges`): still a tie the rater breaks
    thirds = [trial(0, 1.0 - 2 / 3, "Always check your work."), trial(1, 2 / 3 - 1 / 3, "Count both ends.")]
    assert thirds[0].gain != thirds[1].gain
    assert [t.verdict for t in best_per_group(thirds, specific={1})] == ["rejected", "kept"]
    assert parse_rating("x", '{"verdict": "Generic", "reason": "fits  any problem"}').verdict == "generic"
    assert parse_rating("x", "no json here").verdict == "unrated"
    assert parse_rating("x", '{"verdict": "maybe"}').verdict == "unrated"


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_a_lesson_rejected_by_its_trial_is_not_tried_again(tmp_path):
    """The ledger: two epochs over the same problems; the misleading lesson the first step's trials rejected is
    proposed again in the second and rejected there without a trial, naming the first rejection."""
    dataset = write_jsonl(make_problems(n_per_family=2, seed=3), tmp_path / "train.jsonl")
    world = ScriptedWorld(seed=5, p_base=0.2, p_misleading=1.0)
    with FakeOpenAIServer(world) as server:
        cfg = make_config(server, dataset, tmp_path, "ledger", contrast_learning())
        cfg = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"epochs": 2})})
        await train(cfg)
    with Store(cfg.db_path, read_only=True) as store:
        first = store.records("lesson_trials", "ledger", 1)
        second = store.records("lesson_trials", "ledger", 2)
        second_samples = store.records("trial_samples", "ledger", 2)
    assert any(t.verdict == "rejected" and t.reason.startswith("lesson validation: reward") for t in first)
    again = [t for t in second if t.operation.text == MISLEADING_LESSON]
    assert again and all(t.reason.startswith("rejected before, not tried again: step 1: ") for t in again)
    assert not second_samples  # nothing was attempted for it


def test_near_duplicate_candidates_are_one_cluster_tried_once_for_all_their_groups():
    from clgrpo.experience.library import NearDuplicates, normalize_text
    from tasks.candidate_clusters import cluster, joined

    texts = [
        "Count the integers in an inclusive range as the largest minus the smallest plus one.",
        "Count the integers in an inclusive range as the largest minus the smallest, plus one.",
        "Apply a discount to the original price, not to the already discounted one.",
        "Count the integers of an inclusive range as largest minus smallest plus one always.",
    ]
    plan = [Operation(op=OpKind.ADD, text=t, source_groups=[f"g{i}"]) for i, t in enumerate(texts)]
    plan.append(Operation(op=OpKind.MODIFY, target_ids=["E1"], text=texts[0], source_groups=["g4"]))
    by_words = cluster(plan, range(len(plan)), None)  # no embeddings: word-trigram overlap
    assert [c.members for c in by_words] == [(0, 1), (2,), (3,), (4,)]  # a modify is not an add's duplicate
    # with the step's embeddings the threshold is the near-duplicate control's: the rewording joins too
    vectors = {normalize_text(t): v for t, v in zip(texts, ([1.0, 0.0], [0.99, 0.141], [0.0, 1.0], [0.95, 0.312]))}
    near = NearDuplicates(vectors, threshold=0.9, mode="merge")
    assert [c.members for c in cluster(plan, range(4), near)] == [(0, 1, 3), (2,)]
    assert joined(plan, 1, (0, 1, 3)).source_groups == ["g0", "g1", "g3"]
    assert joined(plan, 1, (0, 1, 3)).text == texts[1]


async def test_a_lesson_over_the_word_limit_is_shortened_once_instead_of_dropped():
    from clgrpo.experience.library import word_count
    from clgrpo.llm import LLMClient
    from tasks.shorten import shorten_long

    long_text = " ".join(["When both ends of a range count, subtract the first from the last and add one"] * 3)
    short = "When both ends of a range count, subtract the first from the last and add one."
    asked: list[str] = []

    def learner(request):
        asked.append(request.messages[-1]["content"])
        lesson = request.messages[-1]["content"]
        return [json.dumps({"lesson": short if "still fine" not in lesson else long_text})]

    plan = [
        Operation(op=OpKind.ADD, text=long_text, rationale="r"),  # 51 words: shortened
        Operation(op=OpKind.ADD, text=short),  # within the limit: not asked
        Operation(op=OpKind.ADD, text=long_text + " still fine"),  # the reply is as long: left as it was
        Operation(op=OpKind.DELETE, target_ids=["E1"]),
    ]
    cfg = LearningConfig(min_words=6, max_words=40)
    with FakeOpenAIServer(learner) as server:
        client = LLMClient(ModelConfig(model="m", base_url=server.base_url, api_key_env=None, max_retries=0))
        out, calls = await shorten_long(plan, [0, 1, 2], cfg, "mathematics", client, "validate_lessons")
        await client.aclose()
    assert len(asked) == 2 and len(calls) == 2 and all(c.stage == "validate_lessons" for c in calls)
    # both asks go out together: in either order
    assert any(f"This lesson has {word_count(long_text)} words. Rewrite it in 6 to 40 words.\n" in a for a in asked)
    assert (
        out[0].text == short
        and out[0].rationale == f"r [shortened by the learner from {word_count(long_text)} to 16 words]"
    )
    assert out[1] == plan[1] and out[3] == plan[3]  # within the limit, and not a lesson: untouched
    # still too long after one try: the text as it was, the rationale saying why (the library then refuses it)
    assert out[2].text == plan[2].text
    assert out[2].rationale == f"[not shortened: the learner's rewrite has {word_count(long_text)} words]"


async def test_a_candidate_the_library_refuses_never_stands_for_its_near_duplicates():
    from clgrpo.llm import LLMClient
    from domains.math import MathDomain
    from tasks.trial_choice import cluster_plan

    refused = "Count the integers in an inclusive range as the largest minus the smallest plus one (always))."
    fine = "Count the integers in an inclusive range as the largest minus the smallest plus one, always."
    plan = [
        Operation(op=OpKind.ADD, text=refused, source_groups=["g0"]),
        Operation(op=OpKind.ADD, text=fine, source_groups=["g1"]),
    ]
    cfg = RunConfig(dataset=DatasetConfig(path="unused.jsonl"))
    with FakeOpenAIServer(lambda request: [json.dumps({"verdict": "specific", "reason": "r"})]) as server:
        client = LLMClient(ModelConfig(model="m", base_url=server.base_url, api_key_env=None, max_retries=0))
        tried, clustered, ranked, calls = await cluster_plan(
            cfg, 1, ExperienceLibrary(), plan, [], None, [], client, MathDomain()
        )
        await client.aclose()
    # the refused one is left for its own reason, the other tried alone
    assert clustered == {} and ranked == [] and calls == []
    assert tried == plan


@pytest.mark.parametrize("tries", [1, 3])
async def test_a_cluster_whose_first_member_is_rejected_tries_the_next_one(tries):
    """Embeddings put a misleading lesson and a helpful one of the same topic in one cluster (seen on `ranges`:
    "the difference" and "the difference plus one"); the shorter, misleading text is tried first. With one try the
    cluster stands or falls with it; with more, the next member is tried and kept, carrying the cluster's groups."""
    from clgrpo.experience.library import NearDuplicates, normalize_text
    from clgrpo.llm import LLMClient
    from domains.math import MathDomain
    from schemas.records import Problem
    from tasks.validate_lessons import validate_lessons

    helpful = (
        "When adding multi-digit numbers, always align digits by place value and carry into the next column, "
        "every single time."
    )
    plan = [
        Operation(op=OpKind.ADD, text=MISLEADING_LESSON, source_groups=["sums-000"]),
        Operation(op=OpKind.ADD, text=helpful, source_groups=["sums-001"]),
    ]
    problems = [Problem(problem_id=p["id"], problem=p["problem"], answer=p["answer"]) for p in make_problems(2, 3)]
    near = NearDuplicates({normalize_text(t): [1.0, 0.0] for t in (MISLEADING_LESSON, helpful)}, 0.7, "merge")
    world = ScriptedWorld(seed=5, p_base=0.0)
    with FakeOpenAIServer(world) as server:
        model = ModelConfig(model="scripted", base_url=server.base_url, api_key_env=None, max_retries=0, seed=11)
        cfg = RunConfig(
            dataset=DatasetConfig(path="unused.jsonl"),
            policy=model,
            learning=contrast_learning(samples=3, problems=1, min_gain=0.1, cluster_tries=tries),
        )
        client = LLMClient(model)
        out = await validate_lessons(cfg, 1, ExperienceLibrary(), plan, problems, [], MathDomain(), client, near=near)
        await client.aclose()
    by_seq = {t.seq: t for t in out.lesson_trials}
    assert by_seq[0].verdict == "rejected" and by_seq[0].reason.startswith("lesson validation: reward")
    if tries == 1:
        assert (
            by_seq[1].verdict == "rejected" and "their cluster's members are tried best-rated first" in by_seq[1].reason
        )
        assert {s.seq for s in out.trial_samples} == {-1, 0}
    else:
        assert by_seq[1].verdict == "kept" and by_seq[1].reason.startswith("validated: reward")
        assert by_seq[1].operation.source_groups == ["sums-000", "sums-001"]  # it stands for the whole cluster
        baseline = [s for s in out.trial_samples if s.seq == -1]
        assert len(baseline) == len({(s.problem_id, s.sample_idx) for s in baseline})  # shared, drawn once
