"""End-to-end: the real training flow under the Prefect test harness, against the scripted world over HTTP."""

from collections import Counter

import pytest

from clgrpo.storage.store import ConfigMismatchError, Store
from clgrpo.testing.fake_openai import FakeOpenAIServer, Fault, role_of
from clgrpo.testing.scripted_llm import ScriptedWorld, make_problems, write_jsonl
from flows.train import train
from schemas.config import DatasetConfig, GRPOConfig, LearningConfig, ModelConfig, RunConfig
from tests.gates import UNGATED

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_harness")]


@pytest.fixture
def dataset(tmp_path):
    return write_jsonl(make_problems(n_per_family=4, seed=3), tmp_path / "train.jsonl")


def make_config(server: FakeOpenAIServer, dataset, tmp_path, run_id: str, **learning) -> RunConfig:
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
        db_path=str(tmp_path / "runs.duckdb"),
        dataset=DatasetConfig(path=str(dataset), seed=1),
        policy=model,
        grpo=GRPOConfig(group_size=4, epochs=2, batch_size=16, rollout_chunk_size=5),
        learning=LearningConfig(
            **{"consolidate_chunk_size": 3, "summarize_chunk_size": 4, "library_gate": UNGATED, **learning}
        ),
        concurrency=8,
    )


def policy_requests(server: FakeOpenAIServer) -> int:
    return server.stats.by_role["policy"]


async def test_two_epochs_learn_a_library(dataset, tmp_path):
    world = ScriptedWorld(seed=8, p_garbage=0.3)  # 17 extractor asks: both kinds of bad reply occur
    with FakeOpenAIServer(world) as server:
        # lessons only: their lineage, their citations and a step of 7 stages; a run with worked examples (the
        # default) end to end is tests/test_examples_flow.py's
        cfg = make_config(server, dataset, tmp_path, "e2e", examples="off")
        result = await train(cfg)
        requests = list(server.stats.log)

    assert [r.step for r in result.steps] == [1, 2]
    epoch1, epoch2 = result.steps
    assert epoch2.accuracy > epoch1.accuracy + 0.2, (epoch1.accuracy, epoch2.accuracy)
    assert epoch1.groups_selected > 0 and epoch1.operations_applied > 0

    with Store(cfg.db_path, read_only=True) as store:
        assert store.library_versions("e2e") == [0, 1, 2]
        assert len(store.load_library("e2e", 0)) == 0
        after = store.load_library("e2e", 1)
        assert len(after) > 0 and after.version == 1
        # one row per (step, problem, sample): no duplicate rollouts
        counts = store.query(
            "SELECT step, count(*) AS n, count(DISTINCT (problem_id, sample_idx)) AS d "
            "FROM rollouts WHERE run_id='e2e' GROUP BY step ORDER BY step"
        )
        assert counts["n"].tolist() == [64, 64] and counts["d"].tolist() == [64, 64]
        # lineage: every applied add traces back to group proposals of that step
        applied = store.records("operations", "e2e", 1)
        proposals = store.records("proposals", "e2e", 1, "group_advantage")
        proposed_groups = {p.group_id for p in proposals if p.operations}
        adds = [r for r in applied if r.status.value == "applied" and r.operation.op.value == "add"]
        assert adds and all(
            set(r.operation.source_groups) <= proposed_groups and r.operation.source_groups for r in adds
        )
        assert all(after.by_id[r.result_id].source_groups for r in adds)
        # usefulness: step 2's attempts cited the family lessons they followed, mostly in correct attempts
        stats = {st.exp_id: st for st in store.records("experience_stats", "e2e", 2)}
        assert set(stats) == {e.id for e in store.load_library("e2e", 2)}
        cited = [st for st in stats.values() if st.cited]
        assert cited and all(st.cited_correct > st.cited_wrong and st.confidence > 0.5 for st in cited)
        assert all(st.ci_low < st.confidence < st.ci_high for st in cited)
        assert all(st.cited == 0 for st in store.records("experience_stats", "e2e", 1))  # step 1 saw no lessons
        # every stage of every step is stored, and every LLM call was recorded with its stage
        stages = store.query("SELECT step, stage FROM stage_runs WHERE run_id='e2e' ORDER BY step, stage")
        assert len(stages[stages.step == 1]) == 7 and len(stages[stages.step == 2]) == 7
        calls = store.query("SELECT stage, count(*) AS n FROM llm_calls WHERE run_id='e2e' GROUP BY stage")
        by_stage = dict(zip(calls.stage, calls.n))
        assert by_stage["rollout"] == policy_requests(server)
        assert set(by_stage) == {"rollout", "summarize", "group_advantage", "consolidate"}
        # malformed learner JSON happened and was handled (tolerant parser or repair), never dropped
        assert world.stats.extract_malformed > 0 and world.stats.extract_garbage > 0
        assert world.stats.extract_repairs == world.stats.extract_garbage
        n_groups = store.query("SELECT count(*) AS n FROM group_advantages WHERE run_id='e2e' AND selected")["n"][0]
        n_props = store.query("SELECT count(*) AS n FROM proposals WHERE run_id='e2e' AND stage='group_advantage'")[
            "n"
        ][0]
        assert n_props == n_groups
        # the policy is frozen: only chat completions, same model and config as registered
        assert store.run_config("e2e").policy == cfg.policy
    assert {r.role for r in requests} >= {
        "policy",
        "trajectory summarizer",
        "experience extractor",
        "library consolidator",
    }
    assert (tmp_path / "e2e" / "library_latest.json").exists()


async def test_failed_consolidation_retry_resumes_without_new_rollouts(dataset, tmp_path):
    with FakeOpenAIServer(ScriptedWorld(seed=7)) as server:
        reference = await train(make_config(server, dataset, tmp_path, "uninterrupted"))
        reference_policy_calls = policy_requests(server)
    with Store(tmp_path / "runs.duckdb", read_only=True) as store:
        expected = store.load_library("uninterrupted")

    with FakeOpenAIServer(ScriptedWorld(seed=7)) as server:
        server.inject(Fault(kind="status", status=400, times=1, match=lambda r: role_of(r) == "library consolidator"))
        cfg = make_config(server, dataset, tmp_path, "interrupted")
        state = await train.with_options(retries=1, retry_delay_seconds=0)(cfg, return_state=True)
        assert state.is_completed()
        result = await state.result()
        assert server.stats.faults_served["status:400"] == 1
        # the retry did not request rollouts again
        assert policy_requests(server) == reference_policy_calls

    from prefect.client.orchestration import get_client

    async with get_client() as client:
        flow_run = await client.read_flow_run(state.state_details.flow_run_id)
    assert flow_run.run_count == 2
    with Store(tmp_path / "runs.duckdb", read_only=True) as store:
        assert store.load_library("interrupted").as_dict() == expected.as_dict()
    assert [s.accuracy for s in result.steps] == [s.accuracy for s in reference.steps]


async def test_rerun_after_crash_continues_and_config_change_is_refused(dataset, tmp_path):
    with FakeOpenAIServer(ScriptedWorld(seed=11)) as server:
        server.inject(Fault(kind="status", status=400, times=1, match=lambda r: role_of(r) == "library consolidator"))
        cfg = make_config(server, dataset, tmp_path, "crashy")
        state = await train(cfg, return_state=True)
        assert state.is_failed()
        first_policy = policy_requests(server)

        result = await train(cfg)  # a new flow run, same run id: continues
        assert policy_requests(server) == first_policy * 2  # only step 2's rollouts were new
        assert [r.step for r in result.steps] == [1, 2]

        changed = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"group_size": 3})})
        state = await train(changed, return_state=True)
        assert state.is_failed()
        with pytest.raises(ConfigMismatchError, match="changed: grpo.group_size"):
            await state.result()
    with Store(cfg.db_path, read_only=True) as store:
        roll = store.query("SELECT step, count(*) AS n FROM rollouts WHERE run_id='crashy' GROUP BY step ORDER BY step")
        assert roll["n"].tolist() == [64, 64]
        ops = store.query(
            "SELECT step, count(*) AS n FROM stage_runs WHERE run_id='crashy' "
            "AND stage='apply_operations' GROUP BY step"
        )
        assert ops["n"].tolist() == [1, 1]
    assert Counter(r.role for r in server.stats.log)["policy"] == first_policy * 2


async def test_a_run_without_an_id_gets_one_from_its_flow_run(dataset, tmp_path):
    from prefect.client.orchestration import get_client

    with FakeOpenAIServer(ScriptedWorld(seed=3)) as server:
        cfg = make_config(server, dataset, tmp_path, "unused").model_copy(update={"run_id": None})
        cfg = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"epochs": 1})})
        state = await train(cfg, return_state=True)
    result = await state.result()
    async with get_client() as client:
        flow_run = await client.read_flow_run(state.state_details.flow_run_id)
    assert result.run_id == flow_run.name == f"train-{str(flow_run.id)[:8]}"
    with Store(cfg.db_path, read_only=True) as store:
        assert store.runs().set_index("run_id").loc[result.run_id, "status"] == "completed"
