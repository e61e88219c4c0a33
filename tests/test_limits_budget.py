"""Bounded learning: operation limits a flooding learner cannot pass, budgets that stop a run at a stage
boundary and let it resume, and model-location settings that do not block a resume."""

from __future__ import annotations

import json

import pytest

from clgrpo.storage.store import ConfigMismatchError, Store
from clgrpo.testing.fake_openai import FakeOpenAIServer
from clgrpo.testing.scripted_llm import ScriptedWorld, make_problems, write_jsonl
from flows.train import train
from schemas.config import DatasetConfig, GRPOConfig, LearningConfig, ModelConfig, RunConfig
from schemas.records import Operation, OpKind, Proposal
from tasks.limits import limit_plan, limit_proposals
from tests.gates import UNGATED

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


def flood_text(i: int) -> str:
    """A distinct, harmless lesson per number (no digits, so no rule reads it as an answer)."""
    tag = " ".join(WORDS[int(d)] for d in f"{i:04d}")
    return f"When a problem looks like case {tag}, check every condition before you combine the results."


class FloodingLearner(ScriptedWorld):
    """The scripted world, except that the extractor and the consolidator answer with 1,000 operations."""

    def _extract(self, request, rng) -> str:
        return json.dumps({"operations": [{"op": "add", "text": flood_text(i), "why": "flood"} for i in range(1000)]})

    def _consolidate(self, request, rng) -> str:
        return json.dumps(
            {"operations": [{"op": "add", "text": flood_text(5000 + i), "sources": []} for i in range(1000)]}
        )


def make_config(
    server: FakeOpenAIServer, tmp_path, run_id: str, *, epochs: int = 1, max_tokens: int = 256, **learning
) -> RunConfig:
    dataset = write_jsonl(make_problems(n_per_family=4, seed=3), tmp_path / "train.jsonl")
    model = ModelConfig(
        model="scripted",
        base_url=server.base_url,
        api_key_env=None,
        max_tokens=max_tokens,
        retry_base_delay_s=0.01,
        retry_max_delay_s=0.05,
        timeout_s=10,
    )
    return RunConfig(
        run_id=run_id,
        db_path=str(tmp_path / "runs.duckdb"),
        dataset=DatasetConfig(path=str(dataset), seed=1),
        policy=model,
        grpo=GRPOConfig(group_size=4, epochs=epochs, batch_size=16, rollout_chunk_size=5),
        learning=LearningConfig(**{"library_gate": UNGATED, **learning}),
        concurrency=8,
    )


def test_limits_cut_proposals_and_plans_with_a_reason_for_every_operation_left_out():
    cfg = LearningConfig(max_ops_per_group=3, max_ops_per_step=5)
    ops = [Operation(op=OpKind.ADD, text=flood_text(i)) for i in range(10)]
    kept, over = limit_proposals(
        [Proposal(group_id="g1", operations=ops), Proposal(group_id="g2", operations=ops[:2])], cfg
    )
    assert [len(p.operations) for p in kept] == [3, 2] and len(over) == 7
    assert all("max_ops_per_group=3: group g1 proposed 10" in why for _, why in over)
    plan = limit_plan(ops, bound=8, cfg=cfg)
    assert len(plan.operations) == 5 and len(plan.over) == 5
    assert [why.split(":")[0] for _, why in plan.over] == [
        "over the consolidation bound of 8 operations (proposed operations + library size)"
    ] * 2 + ["over learning.max_ops_per_step=5"] * 3


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_a_1000_operation_learner_changes_the_library_only_within_the_limits(tmp_path):
    with FakeOpenAIServer(FloodingLearner(seed=7)) as server:
        # room for the whole 1,000-operation replies (else they are cut at max_tokens and unparseable)
        cfg = make_config(
            server,
            tmp_path,
            "flood",
            max_tokens=100_000,
            max_learner_tokens=100_000,
            max_ops_per_group=3,
            max_ops_per_step=10,
            max_library_size=8,
            examples="off",  # the learner's operations: worked examples come beside them (tests/test_examples.py)
        )
        result = await train(cfg)
    step = result.steps[0]
    with Store(cfg.db_path, read_only=True) as store:
        proposals = store.records("proposals", "flood", 1, "group_advantage")
        results = store.records("operations", "flood", 1)
        library = store.load_library("flood")
    applied = [r for r in results if r.status == "applied"]
    rejected = [r for r in results if r.status == "rejected"]
    reasons = {r.reason.split(":")[0].split(" (")[0] for r in rejected}
    print(
        f"\n1,000-operation learner: {len(proposals)} group proposals of 1000 ops, consolidation plan 1000 ops -> "
        f"{len(applied)} applied, {len(rejected)} rejected; library {len(library)}; reasons {sorted(reasons)}"
    )
    assert len(library) <= 8 and len(applied) <= 8
    # every operation that was proposed is accounted for: applied, or rejected with the limit it broke
    assert len(results) == len(proposals) * (1000 - 3) + 1000
    assert any("max_ops_per_group=3" in r.reason for r in rejected)
    assert any("max_ops_per_step=10" in r.reason for r in rejected)
    assert any("library" in r.reason and "8" in r.reason for r in rejected)  # max_library_size
    assert step.operations_rejected == len(rejected)


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_a_budget_stops_the_run_at_a_stage_boundary_and_a_larger_budget_resumes_it(tmp_path):
    with FakeOpenAIServer(ScriptedWorld(seed=7)) as server:
        cfg = make_config(server, tmp_path, "budget", epochs=2)
        small = cfg.model_copy(update={"budget": cfg.budget.model_copy(update={"max_tokens": 2000})})
        stopped = await train(small)
        with Store(cfg.db_path, read_only=True) as store:
            status, error = store.query("SELECT status, error FROM runs WHERE run_id = 'budget'").iloc[0]
            spent = int(store.query("SELECT sum(tokens_in + tokens_out) AS t FROM llm_calls")["t"][0])
            stages = set(store.query("SELECT step || ':' || stage AS s FROM stage_runs")["s"])
        requests_before = server.stats.chat_requests
        resumed = await train(cfg)  # no budget: the run continues where it stopped
    print(f"\nbudget 2000 tokens: stopped with {spent} tokens spent: {stopped.stopped}")
    assert (
        stopped.stopped
        and "budget reached before step" in stopped.stopped
        and "budget.max_tokens=2000" in stopped.stopped
    )
    assert status == "budget_exhausted" and "budget reached" in error
    assert spent >= 2000 and len(stages) < 2 * 8  # it stopped before the end
    assert [r.step for r in resumed.steps] == [1, 2] and resumed.stopped is None
    assert server.stats.chat_requests > requests_before


def test_moving_the_model_to_another_port_keeps_the_run_but_another_model_does_not(tmp_path):
    dataset = DatasetConfig(path="t.jsonl")
    base = RunConfig(
        run_id="moved",
        db_path=str(tmp_path / "m.duckdb"),
        dataset=dataset,
        policy=ModelConfig(model="m", base_url="http://127.0.0.1:8000/v1"),
    )
    moved = base.model_copy(
        update={
            "policy": base.policy.model_copy(
                update={"base_url": "http://127.0.0.1:9000/v1", "timeout_s": 30.0, "max_retries": 2, "api_key_env": "K"}
            )
        }
    )
    other = base.model_copy(update={"policy": base.policy.model_copy(update={"model": "m2"})})
    hotter = base.model_copy(update={"policy": base.policy.model_copy(update={"temperature": 1.0})})
    assert moved.fingerprint() == base.fingerprint()
    assert other.fingerprint() != base.fingerprint() and hotter.fingerprint() != base.fingerprint()
    with Store(base.db_path) as store:
        assert store.register_run(base)
        store.write_stage("moved", 1, "checkpoint", {})  # a step is done: changes are now refused
        assert store.register_run(moved) is False  # same run: resumes
        with pytest.raises(ConfigMismatchError, match="policy.model"):
            store.register_run(other)
