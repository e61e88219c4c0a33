"""The LLM judge over real HTTP (a loopback OpenAI-compatible server): verdicts with reasons, unusable replies
and failed calls as ungraded samples (never a 0 standing in for "unknown"), the domain's final-answer reading."""

from __future__ import annotations

import json

import pytest

from clgrpo.llm import LLMClient
from clgrpo.llm.structured import StructuredOutputError
from clgrpo.testing.fake_openai import FakeOpenAIServer, Fault
from domains import get_domain
from schemas.config import DatasetConfig, ModelConfig, RunConfig
from schemas.records import Problem, Rollout, Turn
from tasks.judge import Judge, parse_verdict
from tasks.verify import grade

PROBLEM = Problem(problem_id="q1", problem="In which year was the mayor of Varsk born?", answer="1961")


def client(server: FakeOpenAIServer, tmp_path) -> LLMClient:
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "a", "problem": "q", "answer": "1"}\n')
    model = ModelConfig(
        model="fake-model",
        base_url=server.base_url,
        api_key_env=None,
        max_retries=1,
        retry_base_delay_s=0.01,
        retry_max_delay_s=0.02,
        timeout_s=5,
    )
    return LLMClient.from_run_config(RunConfig(dataset=DatasetConfig(path=str(data)), policy=model))


def rollout(text: str, idx: int = 0) -> Rollout:
    return Rollout(
        problem_id="q1",
        sample_idx=idx,
        prompt_hash="h",
        library_version=0,
        turns=[Turn(kind="assistant", content=text)],
        tokens_in=1,
        tokens_out=1,
    )


def test_verdicts_are_read_leniently_and_refused_without_a_boolean():
    assert parse_verdict('Sure: {"correct": true, "reason": "same year"}') == (True, "same year")
    assert parse_verdict('{"correct": "false", "reason": " off by one "}') == (False, "off by one")
    with pytest.raises(StructuredOutputError, match='no boolean "correct"'):
        parse_verdict('{"verdict": "yes"}')


async def test_the_judge_grades_with_a_reason_and_never_guesses(tmp_path):
    replies = {
        "1961": json.dumps({"correct": True, "reason": "1961 is the reference year"}),
        "1950": json.dumps({"correct": False, "reason": "1950 is not 1961"}),
        "sixty-one": "I think so.",
    }  # no verdict

    def respond(request):
        assert request.messages[0]["content"].startswith("ROLE: answer judge")
        candidate = request.messages[1]["content"].split("<attempt>\n", 1)[1].split("\n</attempt>")[0]
        return [replies[candidate]]

    with FakeOpenAIServer(respond) as server:
        llm = client(server, tmp_path)
        judge = Judge(llm, get_domain("web"), stage="verify")
        rewards = await grade(
            [PROBLEM],
            [
                rollout("It says 1961. Final answer: 1961"),
                rollout("Final answer: 1950", 1),
                rollout("Final answer: sixty-one", 2),
                rollout("no answer line", 3),
            ],
            get_domain("web"),
            judge,
        )
        await llm.aclose()
    first, second, third, fourth = rewards
    assert (first.reward, first.judge_reason) == (1.0, "1961 is the reference year")
    assert (second.reward, second.error, second.judge_reason) == (0.0, "judged wrong", "1950 is not 1961")
    assert third.reward is None and not third.verified  # unusable twice (the verify stage retries once)
    assert third.error.startswith("could not verify: judge reply unusable")
    assert (fourth.reward, fourth.error) == (0.0, "no final answer to judge")  # not sent to the judge


async def test_a_judge_call_that_fails_leaves_the_sample_ungraded(tmp_path):
    with FakeOpenAIServer(lambda request: ['{"correct": true, "reason": "x"}']) as server:
        server.inject(Fault("status", status=500, times=10))
        llm = client(server, tmp_path)
        [reward] = await grade(
            [PROBLEM], [rollout("Final answer: 1961")], get_domain("web"), Judge(llm, get_domain("web"), stage="verify")
        )
        await llm.aclose()
    assert reward.reward is None and not reward.verified and "judge call failed" in reward.error
