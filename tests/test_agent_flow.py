"""Agent mode end to end: the real training and evaluation flows under the Prefect harness, the scripted world
over HTTP driving a ReAct agent whose python calls run in the real sandbox (clgrpo/sandbox/pool.py)."""

from __future__ import annotations

import json

import pytest

from clgrpo.sandbox.isolation import isolation_problem
from clgrpo.storage.store import Store
from clgrpo.testing.fake_openai import ChatRequest, FakeOpenAIServer, Fault, role_of
from clgrpo.testing.scripted_llm import ScriptedWorld, make_problems, write_jsonl
from flows.evaluate import evaluate
from flows.train import train
from schemas.config import (
    AgentConfig,
    DatasetConfig,
    EvalConfig,
    GRPOConfig,
    LearningConfig,
    ModelConfig,
    RolloutPlacement,
    RunConfig,
    SandboxConfig,
    StageTolerances,
    ToleranceConfig,
)
from tasks.integrity import StageFailedError
from tests.gates import UNGATED

pytestmark = [
    pytest.mark.flow,
    pytest.mark.usefixtures("prefect_harness"),
    pytest.mark.skipif(isolation_problem() is not None, reason=str(isolation_problem())),
]

SANDBOX = SandboxConfig(pool_size=4, spares=1, cpu_s=5, wall_s=20)


def agent_config(
    server: FakeOpenAIServer,
    tmp_path,
    run_id: str,
    *,
    protocol: str = "auto",
    epochs: int = 2,
    max_retries: int = 6,
    rollout_tolerance: float = 0.1,
) -> RunConfig:
    dataset = write_jsonl(make_problems(n_per_family=3, seed=3), tmp_path / "train.jsonl")
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
        grpo=GRPOConfig(group_size=4, epochs=epochs, batch_size=12, rollout_chunk_size=4),
        learning=LearningConfig(consolidate_chunk_size=3, summarize_chunk_size=4),
        concurrency=8,
        rollout=RolloutPlacement(mode="agent", agent=AgentConfig(protocol=protocol, max_turns=4, sandbox=SANDBOX)),
        tolerance=ToleranceConfig(max_failed_fraction=StageTolerances(rollout=rollout_tolerance)),
    )


class Recording(ScriptedWorld):
    """The scripted world, keeping every request (to see what the learner was shown)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.requests: list[ChatRequest] = []

    def __call__(self, request: ChatRequest):
        with self._lock:
            self.requests.append(request)
        return super().__call__(request)


async def test_two_agent_steps_learn_a_library_from_tool_use(tmp_path):
    world = Recording(seed=7)
    with FakeOpenAIServer(world) as server:
        cfg = agent_config(server, tmp_path, "agent")
        result = await train(cfg)
        n_requests = server.stats.chat_requests

    epoch1, epoch2 = result.steps
    assert epoch1.operations_applied > 0 and result.library_size > 0
    assert epoch2.accuracy > epoch1.accuracy + 0.2, (epoch1.accuracy, epoch2.accuracy)
    assert epoch1.tool_calls > 0 and epoch2.tool_calls > epoch1.tool_calls  # the lessons made it use the tool
    with Store(cfg.db_path, read_only=True) as store:
        rollouts = store.records("rollouts", "agent", 2)
        calls = store.query("SELECT stage, turn, ok FROM llm_calls WHERE run_id = 'agent'")
        lessons = [e.text for e in store.load_library("agent")]
        table = store.query(
            "SELECT sum(tool_calls) AS calls, sum(tool_errors) AS errors, max(n_turns) AS turns "
            "FROM rollouts WHERE run_id = 'agent'"
        )
    # the python tool really ran: a correct answer needs the sandbox's printed result to reach the model
    used = [r for r in rollouts if r.tool_calls]
    assert used and all(r.error is None for r in rollouts)
    for r in used:
        result_turns = [t for t in r.turns if t.kind == "tool_result" and t.error is None]
        if result_turns:
            assert r.final_text.endswith(f"\\boxed{{{result_turns[-1].content.strip()}}}.")
    assert any(t.error and "SyntaxError" in t.error for r in rollouts for t in r.turns)  # tool errors kept
    assert int(table["calls"][0]) == epoch1.tool_calls + epoch2.tool_calls and int(table["turns"][0]) >= 2
    # every turn is one recorded request with its turn number
    policy = calls[calls.stage == "rollout"]
    assert len(calls) == n_requests and policy["turn"].notna().all() and policy["turn"].max() >= 1
    assert lessons
    # the learner was shown the tool calls and their results
    summaries = [r for r in world.requests if role_of(r) == "trajectory summarizer"]
    assert any(
        "[python call]" in r.messages[-1]["content"] and "[python result" in r.messages[-1]["content"]
        for r in summaries
    )
    extracts = [r for r in world.requests if role_of(r) == "experience extractor"]
    assert any(
        "[python call]" in r.messages[-1]["content"] and "[python result" in r.messages[-1]["content"] for r in extracts
    )  # the raw trajectory, tool calls and results inline


async def test_agent_evaluation_with_the_text_protocol(tmp_path):
    world = Recording(seed=11)
    heldout = write_jsonl(
        [{**p, "id": "h-" + p["id"]} for p in make_problems(n_per_family=2, seed=9)], tmp_path / "heldout.jsonl"
    )
    lessons = tmp_path / "lessons.txt"
    from clgrpo.testing.scripted_llm import FAMILIES

    lessons.write_text("".join(f"[L{i}]. {f.lesson}\n" for i, f in enumerate(FAMILIES)))
    with FakeOpenAIServer(world, supports_tools=False) as server:
        cfg = agent_config(server, tmp_path, "unused", protocol="text")
        evaluation = EvalConfig(dataset=DatasetConfig(path=str(heldout)), k=2, bootstrap_samples=200)
        outcome = await evaluate(cfg, evaluation, ["none", str(lessons)])
    none, with_lessons = outcome.summaries
    assert with_lessons.mean_at_k > none.mean_at_k
    with Store(cfg.db_path, read_only=True) as store:
        results = store.query(
            f"SELECT condition, sum(tool_calls) AS calls FROM eval_results "
            f"WHERE run_id = '{outcome.eval_id}' GROUP BY condition"
        )
    calls = dict(zip(results.condition, results.calls))
    assert calls["lessons.txt"] > calls["none"] >= 0
    policy = [r for r in world.requests if role_of(r) == "policy"]
    assert policy and all(not r.tools for r in policy)  # the text protocol: no tools field
    assert any("<tool_result" in m["content"] for r in policy for m in r.messages if m["role"] == "user")


async def test_a_rerun_after_a_failed_rollout_stage_does_not_redo_finished_agent_rollouts(tmp_path):
    world = Recording(seed=3, p_base=1.0, p_lesson=1.0)  # every rollout calls the tool
    with FakeOpenAIServer(world) as server:

        def after_the_tool(request: ChatRequest) -> bool:  # "products" rollouts die after running their code
            text = json.dumps(request.messages)
            return role_of(request) == "policy" and "(products)" in text and len(request.messages) > 2

        server.inject(Fault(kind="status", status=503, match=after_the_tool, rate=1.0))
        cfg = agent_config(server, tmp_path, "resume", epochs=1, max_retries=1, rollout_tolerance=0.0)
        # the gate off: its first look, drawn beside the rollouts, would count among the policy's first turns
        cfg = cfg.model_copy(update={"learning": cfg.learning.model_copy(update={"library_gate": UNGATED})})
        with pytest.raises(StageFailedError) as failed:
            await train(cfg)
        message = str(failed.value)
        n_failed = int(message.split("rollout: ")[1].split("/")[0])
        total = int(message.split("rollout: ")[1].split("/")[1].split(" ")[0])
        first_attempt = first_turns_of(world)

        server.clear_faults()
        world.requests.clear()
        result = await train(cfg)  # what a Retry of the flow run does
        second_attempt = first_turns_of(world)

    assert message.startswith("step 1 rollout: ") and "HTTP 503" in message
    assert 0 < n_failed < total and first_attempt == total
    assert second_attempt == n_failed  # only the failed agent rollouts start again
    assert [r.step for r in result.steps] == [1]
    with Store(cfg.db_path, read_only=True) as store:
        rollouts = store.records("rollouts", "resume", 1)
    assert len(rollouts) == total and all(r.error is None and r.tool_calls for r in rollouts)


def first_turns_of(world: Recording) -> int:
    return sum(1 for r in world.requests if role_of(r) == "policy" and len(r.messages) == 2)
