"""Nothing lost silently: the training flow against a fault-injecting OpenAI-compatible server over HTTP.

Each test prints its figures. The server counts every chat request it receives (``stats.chat_requests``); the
run must account for each one in ``llm_calls`` (one row per request, with its cause when it failed).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from functools import partial

import pytest

from clgrpo.llm import LLMClient
from clgrpo.prompts.extract import extract_messages
from clgrpo.prompts.repair import repair_messages
from clgrpo.prompts.summarize import summarize_messages
from clgrpo.storage.journal import JOURNAL_DIR
from clgrpo.storage.store import Store
from clgrpo.testing.fake_openai import DEFAULT_MIX, FakeOpenAIServer, Fault, match_roles, role_of
from clgrpo.testing.scripted_llm import ScriptedWorld, make_problems, write_jsonl
from flows.train import train
from schemas.config import DatasetConfig, GRPOConfig, LearningConfig, ModelConfig, RunConfig
from tasks.integrity import StageFailedError
from tests.gates import UNGATED

SUMMARIZER = "trajectory summarizer"
EXTRACTOR = "experience extractor"


def make_config(
    server: FakeOpenAIServer,
    tmp_path,
    run_id: str,
    *,
    n_per_family: int = 4,
    epochs: int = 2,
    max_retries: int = 6,
    group_size: int = 4,
) -> RunConfig:
    dataset = write_jsonl(make_problems(n_per_family=n_per_family, seed=3), tmp_path / "train.jsonl")
    model = ModelConfig(
        model="scripted",
        base_url=server.base_url,
        api_key_env=None,
        max_tokens=256,
        max_retries=max_retries,
        retry_base_delay_s=0.01,
        retry_max_delay_s=0.05,
        timeout_s=10,
    )
    return RunConfig(
        run_id=run_id,
        db_path=str(tmp_path / "runs.duckdb"),
        dataset=DatasetConfig(path=str(dataset), seed=1),
        policy=model,
        grpo=GRPOConfig(group_size=group_size, epochs=epochs, batch_size=16, rollout_chunk_size=5),
        learning=LearningConfig(consolidate_chunk_size=3, summarize_chunk_size=4, library_gate=UNGATED),
        concurrency=8,
    )


def count(store: Store, sql: str) -> int:
    return int(store.query(sql).iloc[0, 0])


def journal_dirs(cfg: RunConfig) -> list:
    from pathlib import Path

    return list((Path(cfg.db_path).parent / JOURNAL_DIR).glob(f"*/{cfg.run_id}"))


# --- the client: every reply fault is a retried, recorded error -------------------------------------------
class Echo:
    def __call__(self, request):
        return [f"reply {i} with a few words" for i in range(request.n)]


@pytest.mark.parametrize(
    "kind, cause",
    [
        ("malformed", "malformed reply"),
        ("no_choices", "no choices"),
        ("empty", "empty reply"),
        ("reset", "connection error"),
        ("drop", "connection error"),
        ("status", "HTTP 500"),
    ],
)
async def test_every_reply_fault_is_retried_and_recorded_with_its_cause(kind, cause):
    with FakeOpenAIServer(Echo()) as server:
        server.inject(Fault(kind=kind, times=2))
        client = LLMClient(
            ModelConfig(
                model="m",
                base_url=server.base_url,
                api_key_env=None,
                retry_base_delay_s=0.01,
                retry_max_delay_s=0.02,
                timeout_s=5,
            )
        )
        done = await client.complete([{"role": "user", "content": "hi"}], stage="summarize")
        await client.aclose()
        requests = server.stats.chat_requests
    assert done.text == "reply 0 with a few words"
    assert [(c.retries, c.ok, c.final) for c in done.calls] == [(0, False, False), (1, False, False), (2, True, True)]
    assert all(cause in c.error for c in done.calls[:2]), [c.error for c in done.calls]
    assert len(done.calls) == requests == 3


async def test_a_truncated_reply_is_kept_and_marked():
    with FakeOpenAIServer(Echo()) as server:
        server.inject(Fault(kind="truncate", times=1, cut_words=2))
        client = LLMClient(ModelConfig(model="m", base_url=server.base_url, api_key_env=None))
        sampled = await client.sample([{"role": "user", "content": "hi"}], 2, stage="rollout")
        await client.aclose()
    assert [(s.text, s.finish_reason) for s in sampled.samples] == [("reply 0", "length"), ("reply 1", "length")]
    assert [c.finish_reason for c in sampled.calls] == ["length"]


async def test_one_failed_sample_keeps_the_others():
    """supports_n false: G single requests; the one that fails after its retries fails alone."""
    with FakeOpenAIServer(Echo(), supports_n=False) as server:
        server.inject(Fault(kind="status", status=500, times=3, match=lambda r: r.seed == 7 + 2))
        client = LLMClient(
            ModelConfig(
                model="m",
                base_url=server.base_url,
                api_key_env=None,
                supports_n=False,
                max_retries=2,
                retry_base_delay_s=0.01,
                retry_max_delay_s=0.02,
                seed=7,
            )
        )
        sampled = await client.sample([{"role": "user", "content": "hi"}], 4, stage="rollout")
        await client.aclose()
    assert [s.index for s in sampled.failed] == [2] and "gave up after 2 retries" in sampled.failed[0].error
    assert [s.text for s in sampled.samples if s.error is None] == ["reply 0 with a few words"] * 3
    assert len(sampled.calls) == server.stats.chat_requests == 3 + 3


# --- whole runs ---------------------------------------------------------------------------------------------
@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_a_two_epoch_run_under_20_percent_mixed_faults_loses_nothing(tmp_path):
    with FakeOpenAIServer(ScriptedWorld(seed=7), seed=11) as server:
        server.inject(Fault.mixed(rate=0.2, kinds=DEFAULT_MIX))
        cfg = make_config(server, tmp_path, "faults")
        started = time.monotonic()
        result = await train(cfg)
        took = time.monotonic() - started
        requests, faults = server.stats.chat_requests, dict(server.stats.faults_served)

    with Store(cfg.db_path, read_only=True) as store:
        rollouts = store.records("rollouts", "faults")
        rewards = store.records("rewards", "faults")
        calls = store.records("llm_calls", "faults")
    per_step = Counter(r.library_version for r in rollouts)
    print(
        f"\n20% mixed faults: {requests} requests served, faults {faults}; llm_calls rows {len(calls)} "
        f"({sum(not c.ok for c in calls)} failed attempts, {sum(c.rate_limited for c in calls)} rate limited); "
        f"rollouts {len(rollouts)} ({sum(r.error is not None for r in rollouts)} failed, "
        f"{sum(r.truncated for r in rollouts)} truncated); {took:.1f} s"
    )
    assert [r.step for r in result.steps] == [1, 2]
    assert sum(faults.values()) > 20  # the mix really hit the run
    # zero lost: every (step, problem, sample) stored, as a result or as an error with its cause
    assert sorted(per_step.values()) == [64, 64]
    assert all(r.turns or r.error for r in rollouts)
    assert len(rewards) == len(rollouts) and all(w.reward is not None or w.error for w in rewards)
    # every request the server saw is a row, each failed one with its cause
    assert len(calls) == requests
    assert all(c.error for c in calls if not c.ok)
    # a malformed, empty or reset reply was never graded as the model's answer
    assert not [w for w in rewards if w.reward == 0.0 and w.extracted is None and "empty" in (w.error or "")]
    assert not journal_dirs(cfg)  # the work journal is gone once everything is in DuckDB


@pytest.mark.long  # about 30 s or more; a shorter test of the same guarantee stays in the default run
@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_a_30_second_429_storm_with_retry_after_1_completes(tmp_path):
    with FakeOpenAIServer(ScriptedWorld(seed=3)) as server:
        server.inject(Fault(kind="status", status=429, retry_after=1, window_s=30))
        cfg = make_config(server, tmp_path, "storm", n_per_family=1, epochs=1, group_size=2)
        started = time.monotonic()
        result = await train(cfg)
        took = time.monotonic() - started
        requests, limited = server.stats.chat_requests, server.stats.faults_served["status:429"]
    with Store(cfg.db_path, read_only=True) as store:
        calls = store.records("llm_calls", "storm")
    per_call = Counter(c.call_id for c in calls if c.rate_limited)
    print(
        f"\n429 storm: {took:.1f} s, {requests} requests, {limited} answered 429; the most rate-limited call "
        f"was retried {max(per_call.values())} times (max_retries is {cfg.policy.max_retries})"
    )
    assert [r.step for r in result.steps] == [1]
    assert took >= 30 and limited > 0
    assert max(per_call.values()) > cfg.policy.max_retries  # retried by time, not by count
    assert len(calls) == requests and sum(c.rate_limited for c in calls) == limited
    assert result.steps[0].rollouts_failed == 0


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_a_learner_outage_mid_step_fails_the_stage_and_a_retry_redoes_only_the_failed_calls(tmp_path):
    with FakeOpenAIServer(ScriptedWorld(seed=7)) as server:
        summaries_seen = itertools.count()

        def outage(request) -> bool:  # the learner dies after its first 5 summaries
            return role_of(request) == SUMMARIZER and next(summaries_seen) >= 5

        server.inject(Fault(kind="status", status=503, match=outage, rate=1.0))
        cfg = make_config(server, tmp_path, "outage", epochs=1, max_retries=1)
        with pytest.raises(StageFailedError) as failed:
            await train(cfg)
        first = Counter(e.role for e in server.stats.log)
        first_requests = server.stats.chat_requests
        with Store(cfg.db_path, read_only=True) as store:
            done = set(store.query("SELECT stage FROM stage_runs WHERE run_id = 'outage' AND step = 1")["stage"])
            status = store.query("SELECT status FROM runs WHERE run_id = 'outage'")["status"][0]
            stored_calls = count(store, "SELECT count(*) FROM llm_calls WHERE run_id = 'outage'")
        message = str(failed.value)
        assert message.startswith("step 1 summarize: ") and "summaries failed" in message and "HTTP 503" in message
        assert "Retry the flow run" in message and "\n" not in message
        assert done == {"rollout", "verify"} and status == "failed"
        assert stored_calls == first_requests  # the failed stage's calls are accounted although it was not stored
        n_failed = int(message.split("summarize: ")[1].split("/")[0])

        server.clear_faults()
        server.reset_stats()
        result = await train(cfg)  # what a Retry of the flow run does: the same run id, same config
        second = Counter(e.role for e in server.stats.log)
        second_requests = server.stats.chat_requests

    with Store(cfg.db_path, read_only=True) as store:
        summaries = store.records("summaries", "outage", 1)
        calls = count(store, "SELECT count(*) FROM llm_calls WHERE run_id = 'outage'")
    print(f"\nlearner outage: first attempt {dict(first)} -> {message[:90]}...; retry {dict(second)}")
    assert [r.step for r in result.steps] == [1]
    assert second["policy"] == 0  # rollouts were stored: nothing sampled again
    assert second[SUMMARIZER] == n_failed  # only the failed summaries are redone
    assert all(s.error is None for s in summaries)
    assert calls == first_requests + second_requests  # every request of both attempts is accounted once


def test_the_learner_sees_that_a_reply_was_cut_off():
    from clgrpo.prompts.attempts import Attempt
    from domains.learner import LearnerPrompts
    from schemas.records import Problem

    problem = Problem(problem_id="p1", problem="What is 2+2?", answer="4")
    cut = Attempt(0, "We add 2 and", 0.0, truncated=True)
    prompts = LearnerPrompts()
    summarize = summarize_messages(prompts.ask(use_groundtruth=True), problem, cut, "")[1]["content"]
    extract = extract_messages(
        prompts.ask(use_groundtruth=True, max_ops=2, min_words=5, max_words=30),
        problem,
        [cut, Attempt(1, "4", 1.0)],
        "",
    )[1]["content"]
    assert "cut off at the token limit" in summarize
    assert extract.count("cut off at the token limit") == 1


async def test_a_500_that_rejects_response_format_falls_back_to_prompt_and_parser():
    """llama-cpp-python 0.3.x answers a json_schema response_format with HTTP 500 (seen over real HTTP)."""

    def old_llama(request):
        if (request.response_format or {}).get("type") == "json_schema":
            raise ValueError("response_format.type: Input should be 'text' or 'json_object'")
        return ['{"operations": []}']

    with FakeOpenAIServer(old_llama) as server:
        client = LLMClient(ModelConfig(model="m", base_url=server.base_url, api_key_env=None, max_retries=0))
        done = await client.complete(
            [{"role": "user", "content": "hi"}], stage="group_advantage", json_schema={"type": "object"}
        )
        again = await client.complete(
            [{"role": "user", "content": "hi"}], stage="group_advantage", json_schema={"type": "object"}
        )
        await client.aclose()
    assert done.text == again.text == '{"operations": []}'
    assert server.stats.chat_requests == 3  # the rejected one, then prompt + parser from then on
    assert [(c.ok, "response_format refused" in (c.error or "")) for c in done.calls] == [(False, True), (True, False)]


async def test_an_unusable_first_reply_that_a_repair_replaced_is_kept():
    replies = iter(
        [
            "I think a lesson about pairs would help.",
            '{"operations": [{"op": "add", "text": "When a sum has many terms, add them in pairs first."}]}',
        ]
    )

    with FakeOpenAIServer(lambda request: [next(replies)]) as server:
        client = LLMClient(ModelConfig(model="m", base_url=server.base_url, api_key_env=None, max_retries=0))
        from domains.learner import LearnerPrompts

        done = await client.complete_operations(
            [{"role": "user", "content": "edits?"}],
            stage="group_advantage",
            json_schema={"type": "object"},
            repair=partial(repair_messages, LearnerPrompts().ask()),
        )
        await client.aclose()
    assert len(done.operations) == 1 and done.parse_error is None
    assert [c.reply for c in done.calls] == ["I think a lesson about pairs would help.", done.raw_text]


async def test_a_refused_schema_switches_the_learner_prompts_to_the_example_style():
    """The call that finds the schema refused is asked again with the prompt written for an unconstrained reply
    (its example reply shown), and so is every later learner prompt of that model: the grammar no longer shows
    the shape, the example must."""
    from domains.learner import LearnerPrompts
    from schemas.records import Problem

    seen: list[tuple[bool, bool]] = []  # (response_format sent, example reply in the prompt)

    def old_llama(request):
        seen.append((request.response_format is not None, "An example of a reply" in request.messages[0]["content"]))
        if (request.response_format or {}).get("type") == "json_schema":
            raise ValueError("response_format.type: Input should be 'text' or 'json_object'")
        return ['{"operations": [{"op": "add", "text": "When a sum has many terms, add them in pairs first."}]}']

    prompts, problem = LearnerPrompts(), Problem(problem_id="p1", problem="What is 2+2?", answer="4")

    def messages(constrained: bool):
        return extract_messages(
            prompts.ask(use_groundtruth=True, max_ops=1, min_words=3, max_words=30),
            problem,
            [],
            "",
            show_example=not constrained,
        )

    with FakeOpenAIServer(old_llama) as server:
        client = LLMClient(ModelConfig(model="schema-less", base_url=server.base_url, api_key_env=None, max_retries=0))
        assert client.constrains_json("learner")
        first = await client.complete_operations(
            messages,
            stage="group_advantage",
            json_schema={"type": "object"},
            repair=partial(repair_messages, prompts.ask()),
        )
        assert not client.constrains_json("learner")
        later = await client.complete_operations(
            messages,
            stage="group_advantage",
            json_schema={"type": "object"},
            repair=partial(repair_messages, prompts.ask()),
        )
        await client.aclose()
    assert seen == [(True, False), (False, True), (False, True)]
    assert len(first.operations) == len(later.operations) == 1
    assert [(c.ok, "response_format refused" in (c.error or "")) for c in first.calls] == [(False, True), (True, False)]
    assert [c.reply for c in first.calls] == [None, first.raw_text]  # a learner reply is stored with its call


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_failures_within_the_tolerance_are_stored_counted_and_the_run_goes_on(tmp_path):
    with FakeOpenAIServer(ScriptedWorld(seed=7)) as server:
        server.inject(Fault(kind="status", status=500, times=1, match=match_roles("policy")))
        cfg = make_config(server, tmp_path, "within", epochs=1, max_retries=0)
        result = await train(cfg)
    step = result.steps[0]
    with Store(cfg.db_path, read_only=True) as store:
        failed = [r for r in store.records("rollouts", "within") if r.error]
        rewards = {(w.problem_id, w.sample_idx): w for w in store.records("rewards", "within")}
    # one n=4 request failed: 4 of 64 samples (6%, under the default rollout tolerance of 10%)
    assert step.rollouts_failed == len(failed) == 4 and step.llm_failed == 1
    assert all("HTTP 500" in r.error for r in failed)
    assert all(rewards[(r.problem_id, r.sample_idx)].reward is None for r in failed)  # not graded as 0
    assert all(rewards[(r.problem_id, r.sample_idx)].error.startswith("rollout failed") for r in failed)
