"""The pipelined path (per-group rollout -> verify -> summarize -> advantage) stores exactly what the stage-by-stage
path stores, and really overlaps: summaries start while the batch's slowest rollout is still running."""

import pytest

from clgrpo.storage.store import Store, _changed_paths
from clgrpo.testing.fake_openai import ChatRequest, FakeOpenAIServer, RequestLogEntry, role_of
from clgrpo.testing.scripted_llm import ScriptedWorld, make_problems, write_jsonl
from flows.train import train
from schemas.config import DatasetConfig, GRPOConfig, LearningConfig, ModelConfig, RunConfig
from tests.gates import UNGATED

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_harness")]

_PROBLEMS = make_problems(n_per_family=4, seed=3)
SLOW = _PROBLEMS[0]["problem"]  # this problem's rollouts are the batch's stragglers


def latency(request: ChatRequest) -> float:
    slow = role_of(request) == "policy" and SLOW in request.messages[-1]["content"]
    return 0.8 if slow else 0.01


def make_config(server: FakeOpenAIServer, tmp_path, run_id: str, pipeline: bool) -> RunConfig:
    model = ModelConfig(
        model="scripted",
        base_url=server.base_url,
        api_key_env=None,
        max_tokens=256,
        retry_base_delay_s=0.01,
        retry_max_delay_s=0.05,
        timeout_s=10,
    )
    return RunConfig(
        run_id=run_id,
        db_path=str(tmp_path / f"{run_id}.duckdb"),
        dataset=DatasetConfig(path=str(write_jsonl(_PROBLEMS, tmp_path / "train.jsonl")), shuffle=False),
        policy=model,
        grpo=GRPOConfig(group_size=4, epochs=2, batch_size=16, rollout_chunk_size=5),
        learning=LearningConfig(consolidate_chunk_size=3, summarize_chunk_size=4, library_gate=UNGATED),
        concurrency=8,
        pipeline=pipeline,
    )


def stored(cfg: RunConfig) -> dict:
    with Store(cfg.db_path, read_only=True) as store:
        rid = cfg.run_id
        rollouts = [r.model_dump(exclude={"latency_s"}) for r in store.records("rollouts", rid)]
        calls = store.query(
            "SELECT step, stage, count(*) AS n, sum(tokens_in) AS i, sum(tokens_out) AS o "
            "FROM llm_calls WHERE run_id = ? GROUP BY ALL ORDER BY ALL",
            [rid],
        )
        stages = store.query("SELECT step, stage, n_rows FROM stage_runs WHERE run_id = ? ORDER BY ALL", [rid])
        return {
            "rollouts": rollouts,
            "rewards": store.records("rewards", rid),
            "advantages": store.records("group_advantages", rid),
            "summaries": store.records("summaries", rid),
            "proposals": store.records("proposals", rid),
            "operations": store.records("operations", rid),
            "calls": calls.to_dict(orient="records"),
            "stages": stages.to_dict(orient="records"),
            "library": store.load_library(rid).as_dict(),
        }


def first_step(log: list[RequestLogEntry]) -> list[RequestLogEntry]:
    """The requests of step 1: everything that started before its consolidation."""
    boundary = min(e.started for e in log if e.role == "library consolidator")
    return [e for e in log if e.started < boundary]


async def test_pipelined_stores_the_same_records_and_overlaps_stages(tmp_path):
    runs = {}
    for pipeline in (False, True):
        with FakeOpenAIServer(ScriptedWorld(seed=7), latency=latency) as server:
            cfg = make_config(server, tmp_path, f"pipeline-{pipeline}", pipeline)
            await train(cfg)
            runs[pipeline] = (stored(cfg), first_step(list(server.stats.log)))

    (barrier, barrier_log), (piped, piped_log) = runs[False], runs[True]
    assert piped["library"] and piped["operations"]
    for key in barrier:
        assert piped[key] == barrier[key], key

    def last_rollout_end(log: list[RequestLogEntry]) -> float:
        return max(e.ended for e in log if e.role == "policy")

    def first_summary_start(log: list[RequestLogEntry]) -> float:
        return min(e.started for e in log if e.role == "trajectory summarizer")

    assert first_summary_start(barrier_log) >= last_rollout_end(barrier_log)
    assert first_summary_start(piped_log) < last_rollout_end(piped_log) - 0.5


def test_pipeline_flag_is_not_part_of_the_fingerprint():
    base = RunConfig(dataset=DatasetConfig(path="x.jsonl"))
    other = base.model_copy(update={"pipeline": not base.pipeline})
    assert base.fingerprint() == other.fingerprint()
    assert list(_changed_paths(base.model_dump(mode="json"), other.model_dump(mode="json"))) == []
