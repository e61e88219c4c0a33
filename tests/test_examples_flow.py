"""Worked examples end to end: the real training flow under the Prefect test harness, against the scripted world
over HTTP (a policy helped by an example of its family as by its lesson; a writer that slips a fifth of the time)."""

from __future__ import annotations

import pytest

from clgrpo.storage.store import Store
from clgrpo.testing.fake_openai import FakeOpenAIServer
from clgrpo.testing.scripted_llm import ScriptedWorld, make_problems, write_jsonl
from flows.train import train
from schemas.config import (
    DatasetConfig,
    GRPOConfig,
    LearningConfig,
    LessonValidation,
    LibraryGate,
    ModelConfig,
    RunConfig,
)
from schemas.records import OperationResult, OpStatus, Proposal
from schemas.stages import Stage

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_harness")]


def make_config(server: FakeOpenAIServer, tmp_path, run_id: str, **learning) -> RunConfig:
    dataset = write_jsonl(make_problems(n_per_family=6, seed=4), tmp_path / "train.jsonl")
    model = ModelConfig(
        model="scripted", base_url=server.base_url, api_key_env=None, max_tokens=256, retry_base_delay_s=0.01,
        retry_max_delay_s=0.05, timeout_s=10,
    )  # fmt: skip
    return RunConfig(
        run_id=run_id,
        db_path=str(tmp_path / "runs.duckdb"),
        dataset=DatasetConfig(path=str(dataset), seed=1),
        policy=model,
        grpo=GRPOConfig(group_size=4, epochs=1, batch_size=24, rollout_chunk_size=8),
        learning=LearningConfig(
            **{
                "extract": "contrast",
                "summarize": False,
                "consolidation": "passthrough",
                "lesson_validation": LessonValidation(enabled=True, samples=4, problems=2),
                "library_gate": LibraryGate(enabled=True, min_problems=1, share=0.25),
                "checks_budget": None,
                **learning,
            }
        ),
        concurrency=8,
    )


async def test_a_run_learns_worked_examples_from_rollouts_and_rationalizations(tmp_path):
    world = ScriptedWorld(seed=11, p_base=0.25, p_lesson=0.95)
    with FakeOpenAIServer(world) as server:
        cfg = make_config(server, tmp_path, "examples", examples="rationalize", rationalize_max=3)
        await train(cfg)
    assert world.stats.by_role["worked-example writer"] == 3  # one ask per unsolved group, at most 3
    with Store(cfg.db_path, read_only=True) as store:
        rationales = store.records(Proposal, "examples", 1, Stage.RATIONALIZE.value)
        results = store.records(OperationResult, "examples", 1)
        library = store.load_library("examples")
    assert len(rationales) == 3
    kept = [p for p in rationales if p.operations]
    for p in rationales:  # a slip is kept with why, never proposed
        assert bool(p.operations) != bool(p.parse_error), p
    assert all(op.example.origin == "rationalized" for p in kept for op in p.operations)
    tried = [r for r in results if r.operation.example is not None]
    origins = {r.operation.example.origin for r in tried}
    assert "rollout" in origins, "mixed groups offer their favoured attempt"
    assert all(r.reason for r in tried if r.status == OpStatus.REJECTED)  # every rejection says why
    applied = [r for r in tried if r.status == OpStatus.APPLIED]
    assert applied, [r.reason for r in tried]  # the scripted policy is helped by examples: some pass
    assert {e.id for e in library.examples} == {r.result_id for r in applied}
    for e in library.examples:
        assert e.example.problem and e.text and e.source_groups  # provenance kept
