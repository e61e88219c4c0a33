"""The web domain end to end: the real training and evaluation flows under the Prefect harness, a scripted
browsing agent over HTTP whose ``open`` calls fetch the generated site on loopback through the real tool (safety
rules, extraction, links), with and without ground truth."""

from __future__ import annotations

import pytest

from clgrpo.storage.store import Store
from clgrpo.testing.fake_openai import FakeOpenAIServer
from clgrpo.testing.web_world import SiteServer, build_site, make_questions, make_towns, write_questions
from domains.web.settings import OpenConfig, SearchConfig, WebSettings
from flows.evaluate import evaluate
from flows.train import train
from schemas.config import (
    AgentConfig,
    DatasetConfig,
    EvalConfig,
    GRPOConfig,
    JudgeConfig,
    LearningConfig,
    ModelConfig,
    RolloutPlacement,
    RunConfig,
)
from tests.gates import UNGATED
from tests.scripted_web import WEB_LESSON, ScriptedWebWorld

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_harness")]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    folder = build_site(tmp_path_factory.mktemp("site"), make_towns(6, seed=5))
    with SiteServer(folder) as server:
        yield folder, server


def web_config(
    tmp_path,
    site,
    server: FakeOpenAIServer,
    run_id: str,
    *,
    use_groundtruth: bool = True,
    judge: JudgeConfig | None = None,
) -> RunConfig:
    folder, web = site
    questions = write_questions(make_questions(make_towns(6, seed=5), web.base_url), tmp_path / "web.jsonl")
    model = ModelConfig(
        model="scripted",
        base_url=server.base_url,
        api_key_env=None,
        max_tokens=256,
        retry_base_delay_s=0.01,
        retry_max_delay_s=0.05,
        timeout_s=10,
    )
    tools = WebSettings(
        search=SearchConfig(index=str(folder), base_url=web.base_url),
        open=OpenConfig(allow_hosts=["127.0.0.1"], timeout_s=10),
    )
    return RunConfig(
        run_id=run_id,
        db_path=str(tmp_path / "runs.duckdb"),
        domain="web",
        policy=model,
        concurrency=8,
        dataset=DatasetConfig(path=str(questions), problem_field="question", url_field="root_url", seed=1),
        grpo=GRPOConfig(group_size=4, epochs=2, batch_size=12, rollout_chunk_size=4),
        learning=LearningConfig(
            use_groundtruth=use_groundtruth, consolidation="passthrough", summarize_chunk_size=4, library_gate=UNGATED
        ),
        rollout=RolloutPlacement(mode="agent", agent=AgentConfig(protocol="tools", max_turns=6)),
        judge=judge,
        domain_settings=tools.model_dump(),
    )


async def test_two_web_steps_learn_to_walk_the_site_graded_by_the_judge(tmp_path, site):
    world = ScriptedWebWorld(seed=3)
    with FakeOpenAIServer(world) as server:
        cfg = web_config(tmp_path, site, server, "web", judge=JudgeConfig())
        result = await train(cfg)
        report = await evaluate(
            cfg, EvalConfig(dataset=cfg.dataset, k=2, temperature=0.3), [f"{cfg.run_id}:0", f"{cfg.run_id}:latest"]
        )

    first, second = result.steps
    assert first.tool_calls > 0 and second.accuracy > first.accuracy + 0.3, (first.accuracy, second.accuracy)
    with Store(cfg.db_path, read_only=True) as store:
        lessons = [e.text for e in store.load_library(cfg.run_id)]
        rollouts = store.records("rollouts", cfg.run_id, 2)
        rewards = store.records("rewards", cfg.run_id)
        judged = store.query(
            "SELECT stage, role, count(*) AS n FROM llm_calls WHERE run_id = 'web' AND stage = 'verify' GROUP BY ALL"
        )
        eval_reasons = store.query(
            f"SELECT count(judge_reason) AS n FROM eval_results WHERE run_id = '{report.eval_id}'"
        )
    assert WEB_LESSON in lessons
    pages = [t for r in rollouts for t in r.turns if t.kind == "tool_result" and t.content.startswith("Title: ")]
    assert pages and any("was born in" in t.content or "km long" in t.content for t in pages)  # fetched, stored
    assert all(url.startswith(site[1].base_url) for url in world.opened)
    graded = [r for r in rewards if r.extracted is not None]  # a guess or a found value: the judge saw it
    assert graded and all(r.judge_reason for r in graded) and all(r.verified for r in rewards)
    assert any(r.reward == 1.0 and r.judge_reason == "it states the reference value" for r in graded)
    assert list(judged["role"]) == ["learner"] and int(judged["n"][0]) == len(graded)  # every verdict accounted
    assert int(eval_reasons["n"][0]) > 0 and world.counts["answer judge"] == len(graded) + int(eval_reasons["n"][0])
    baseline, learned = report.summaries
    assert learned.mean_at_k > baseline.mean_at_k and learned.mean_ci_low <= learned.mean_at_k <= learned.mean_ci_high


async def test_without_ground_truth_the_attempts_are_compared_on_their_own(tmp_path, site):
    world = ScriptedWebWorld(seed=4)
    with FakeOpenAIServer(world) as server:
        cfg = web_config(tmp_path, site, server, "web-no-gt", use_groundtruth=False, judge=JudgeConfig())
        result = await train(cfg)
    with Store(cfg.db_path, read_only=True) as store:
        lessons = [e.text for e in store.load_library(cfg.run_id)]
    assert WEB_LESSON in lessons and result.steps[0].groups_selected == result.steps[0].groups_total
    assert world.counts["answer judge"] == 0  # the learner compared the attempts; the judge was skipped
