import os
import subprocess
import sys
import textwrap
from datetime import datetime, timezone
from pathlib import Path

import pytest

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.storage.connection import StoreError, StoreLockedError
from clgrpo.storage.store import ConfigMismatchError, FrameValidationError, Store
from schemas.catalog import TABLES
from schemas.config import DatasetConfig, RunConfig
from schemas.records import (
    AdapterVersion,
    GroupAdvantage,
    LLMCall,
    Operation,
    OperationResult,
    Problem,
    Proposal,
    RefreshDecision,
    ReviewRequest,
    Reward,
    Rollout,
    Summary,
    Turn,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def store(tmp_path):
    with Store(tmp_path / "runs.duckdb") as s:
        yield s


def rollouts(problem_id="p1", n=3, text="answer \\boxed{4}"):
    return [
        Rollout(
            problem_id=problem_id,
            sample_idx=i,
            prompt_hash="abc",
            library_version=0,
            turns=[Turn(kind="assistant", content=f"{text} #{i}")],
            tokens_in=10,
            tokens_out=5,
            latency_s=0.1,
        )
        for i in range(n)
    ]


def test_every_table_has_a_pandera_model_with_the_same_columns(store):
    assert set(TABLES) == set(store.query("SELECT table_name FROM duckdb_tables()")["table_name"])
    for table, declared in TABLES.items():
        db_columns = list(store.query(f"SELECT * FROM {table} LIMIT 0").columns)
        assert db_columns == list(declared.frame.to_schema().columns), table


def test_round_trip_of_every_stage_record(store):
    outputs = {
        "problems": [Problem(problem_id="p1", problem="1+3?", answer="4", source="t.jsonl")],
        "rollouts": rollouts(),
        "rewards": [Reward(problem_id="p1", sample_idx=0, reward=1.0, extracted="4")],
        "group_advantages": [
            GroupAdvantage(
                problem_id="p1",
                rewards=[1.0, 0.0],
                mean_reward=0.5,
                std_reward=0.5,
                advantages=[1.0, -1.0],
                selected=True,
                reason="mixed rewards",
            )
        ],
        "summaries": [Summary(problem_id="p1", sample_idx=0, text="added the numbers")],
        "proposals": [
            Proposal(group_id="p1", operations=[Operation(op="add", text="Add carefully.")], raw_text="{...}"),
            Proposal(group_id="p2", raw_text="not json", parse_error="no JSON object found"),
        ],
        "operations": [
            OperationResult(
                seq=0,
                operation=Operation(op="modify", target_ids=["E9"], text="x"),
                status="rejected",
                reason="unknown id: E9",
            )
        ],
        "llm_calls": [LLMCall(stage="all", role="policy", model="m", tokens_in=3, tokens_out=4, retries=1)],
    }
    store.write_stage("r1", 1, "all", outputs)
    for table, records in outputs.items():
        assert store.records(table, "r1", 1, "all") == records, table


def test_rewriting_a_stage_replaces_its_rows(store):
    store.write_stage("r1", 1, "rollout", {"rollouts": rollouts(n=3)})
    store.write_stage("r1", 1, "rollout", {"rollouts": rollouts(n=2, text="retry")})
    store.write_stage("r1", 2, "rollout", {"rollouts": rollouts(n=4)})
    step1 = store.records("rollouts", "r1", 1)
    assert [r.final_text for r in step1] == ["retry #0", "retry #1"]
    assert len(store.frame("rollouts", "r1")) == 6
    assert store.stage_done("r1", 1, "rollout") and not store.stage_done("r1", 3, "rollout")
    marker = store.query("SELECT n_rows FROM stage_runs WHERE run_id='r1' AND step=1")
    assert marker["n_rows"].tolist() == [2]


def test_invalid_frame_names_table_column_and_row_and_keeps_stored_rows(store):
    store.write_stage("r1", 1, "rollout", {"rollouts": rollouts(n=2)})
    bad = [
        Reward.model_construct(problem_id="p1", sample_idx=i, reward=r, extracted=None, error=None)
        for i, r in enumerate([1.0, 1.5])
    ]
    with pytest.raises(FrameValidationError) as err:
        store.write_stage("r1", 1, "rollout", {"rollouts": rollouts(n=5), "rewards": bad})
    assert "table rewards" in str(err.value) and "'reward'" in str(err.value) and "row 1" in str(err.value)
    assert len(store.records("rollouts", "r1", 1)) == 2  # the earlier write is intact
    assert store.frame("rewards", "r1").empty


def test_duplicate_rollout_rows_are_refused(store):
    dup = rollouts(n=2) + rollouts(n=1)
    with pytest.raises(FrameValidationError, match="one_row_per_sample"):
        store.write_stage("r1", 1, "rollout", {"rollouts": dup})


def test_failed_transaction_leaves_previous_rows(store, monkeypatch):
    store.write_stage("r1", 1, "rollout", {"rollouts": rollouts(n=2)})
    original = store._insert

    def failing_insert(table, frame):
        if table == "stage_runs":
            raise RuntimeError("disk full")
        original(table, frame)

    monkeypatch.setattr(store, "_insert", failing_insert)
    with pytest.raises(RuntimeError, match="disk full"):
        store.write_stage("r1", 1, "rollout", {"rollouts": rollouts(n=4)})
    monkeypatch.undo()
    assert len(store.records("rollouts", "r1", 1)) == 2


def test_library_versions_round_trip(store):
    lib = ExperienceLibrary()
    v1, _ = lib.apply(
        [Operation(op="add", text="Lesson one.", source_groups=["p1"]), Operation(op="add", text="Lesson two.")], step=1
    )
    v2, _ = v1.apply([Operation(op="merge", target_ids=["E0", "E1"], text="Both lessons.")], step=2)
    for version in (lib, v1, v2):
        store.save_library("r1", version)
    store.save_library("r1", v2)  # idempotent
    assert store.library_versions("r1") == [0, 1, 2]
    loaded = store.load_library("r1")
    assert loaded == v2 and loaded.retired_ids == {"E0", "E1"} and loaded.next_id == 3
    assert loaded.by_id["E2"].parent_ids == ["E0", "E1"] and loaded.by_id["E2"].source_groups == ["p1"]
    assert store.load_library("r1", 1).as_dict() == v1.as_dict()
    assert len(store.load_library("r1", 0)) == 0
    with pytest.raises(StoreError, match="no library version 7"):
        store.load_library("r1", 7)


def test_run_registration_refuses_a_changed_config_once_a_step_is_done(store):
    cfg = RunConfig(run_id="r1", dataset=DatasetConfig(path="a.jsonl"))
    assert store.register_run(cfg) is True
    assert store.register_run(cfg.model_copy(update={"concurrency": 4})) is False  # not a result-shaping field
    store.write_stage("r1", 1, "checkpoint", {})
    changed = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"group_size": 8})})
    with pytest.raises(ConfigMismatchError, match="changed: grpo.group_size"):
        store.register_run(changed)
    assert store.run_config("r1") == cfg
    assert store.runs()["run_id"].tolist() == ["r1"]


def test_a_run_without_a_finished_step_restarts_with_a_changed_config(store):
    first = RunConfig(run_id="r1", dataset=DatasetConfig(path="missing.jsonl"))
    assert store.register_run(first) is True
    store.write_stage("r1", 0, "load_dataset", {"problems": [Problem(problem_id="p", problem="q?", answer="1")]})
    store.set_run_status("r1", "failed", "DatasetError: missing.jsonl")
    fixed = first.model_copy(update={"dataset": DatasetConfig(path="fixed.jsonl")})
    assert store.register_run(fixed) is True  # restarted: the old rows are gone
    assert store.run_config("r1") == fixed and store.records("problems", "r1") == []
    run = store.runs().iloc[0]
    assert (run["status"], run["steps_done"], run["error"]) == ("running", 0, None)


def test_runs_list_status_steps_library_and_delete(store):
    cfg = RunConfig(run_id="r1", dataset=DatasetConfig(path="a.jsonl"))
    store.register_run(cfg)
    store.register_run(cfg.model_copy(update={"run_id": "r2"}))
    library, _ = ExperienceLibrary().apply([Operation(op="add", text="When stuck, try small cases first.")], step=1)
    store.save_library("r1", library)
    store.write_stage("r1", 1, "rollouts-and-more", {"llm_calls": [LLMCall(stage="rollout", role="policy", model="m")]})
    store.write_stage("r1", 1, "checkpoint", {})
    store.set_run_status("r1", "completed")
    store.set_run_status("r2", "failed", "RuntimeError: endpoint down")
    runs = store.runs().set_index("run_id")
    assert runs.loc["r1", ["status", "steps_done", "library_version", "library_size"]].tolist() == [
        "completed",
        1,
        1,
        1,
    ]
    assert runs.loc["r2", "status"] == "failed" and runs.loc["r2", "error"] == "RuntimeError: endpoint down"
    assert runs.loc["r1", "updated_at"] >= runs.loc["r1", "created_at"]
    removed = store.delete_run("r1")
    assert removed == {"runs": 1, "stage_runs": 2, "llm_calls": 1, "library_versions": 1, "library_experiences": 1}
    assert store.runs()["run_id"].tolist() == ["r2"] and store.library_versions("r1") == []


def test_a_process_holding_the_file_gets_a_clear_lock_error_after_the_wait(tmp_path):
    path = tmp_path / "held.duckdb"
    with Store(path) as store, store.connected():  # held open, as another program (a DuckDB shell) might
        script = textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(ROOT)!r})
            from clgrpo.storage.connection import StoreLockedError
            from clgrpo.storage.store import Store
            try:
                Store({str(path)!r}, wait_s=0.5)
            except StoreLockedError as exc:
                print(exc)
                sys.exit(3)
        """)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert str(path) in proc.stdout and f"process {os.getpid()} kept this DuckDB file open for 0.5 s" in proc.stdout
    assert StoreLockedError.__mro__[1] is StoreError


def test_a_store_holds_the_file_only_while_a_method_works(tmp_path):
    path = tmp_path / "shared.duckdb"
    with Store(path) as store:
        store.set_run_status("r1", "running")  # works, then lets go of the file
        script = textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(ROOT)!r})
            from clgrpo.storage.store import Store
            with Store({str(path)!r}, read_only=True, wait_s=0) as store:
                print(store.db_id, len(store.runs()))
        """)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == [store.db_id, "0"]
        with store.connected() as con:  # nested calls reuse one attachment
            assert store.is_run("r1") is False and con is store.con
        assert store._depth == 0 and not store._pinned


def test_only_the_first_open_creates_the_tables(tmp_path, monkeypatch):
    import clgrpo.storage.connection as connection_module

    calls = []
    real = connection_module.create_statements
    monkeypatch.setattr(connection_module, "create_statements", lambda: calls.append(1) or real())
    with Store(tmp_path / "once.duckdb") as store:
        for _ in range(3):
            store.steps_done("r1")
    assert calls == [1]


def test_a_run_s_spending_is_every_call_of_it(store):
    assert store.spent("r1") == (0, 0.0)
    calls = [
        LLMCall(stage="rollout", role="policy", model="m", tokens_in=10, tokens_out=5, cost_usd=0.25),
        LLMCall(stage="summarize", role="learner", model="m", tokens_in=7, tokens_out=1, cost_usd=0.5, ok=False),
    ]
    store.write_stage("r1", 1, "rollout", {LLMCall: calls[:1]})
    store.write_unfinished("r1", 1, "summarize", {LLMCall: calls[1:]})  # a failed attempt's calls count too
    store.write_stage("r2", 1, "rollout", {LLMCall: calls})
    assert store.spent("r1") == (23, 0.75)


def test_the_adapter_before_a_step_is_the_latest_earlier_one(store):
    def adapter(step):
        return AdapterVersion(base_model="m", rank=4, rows_used=8, library_version=step - 1, path=f"/a/step{step}")

    for step in (1, 3):
        store.write_stage("r1", step, "numeric_update", {AdapterVersion: [adapter(step)]})
    store.write_stage("r2", 2, "numeric_update", {AdapterVersion: [adapter(2)]})
    assert [store.adapter_before("r1", step) for step in (1, 2, 3, 4)] == [None, "/a/step1", "/a/step1", "/a/step3"]


def test_a_review_is_found_by_the_flow_run_that_requested_it(store):
    pending = RefreshDecision(
        refresh_id="nightly-2026-01-02",
        name="nightly",
        refresh_date="2026-01-02",
        cutoff=datetime(2026, 1, 2, tzinfo=timezone.utc),
        status="not_promoted",
        n_new_problems=3,
        baseline_ref="none",
        metric="mean_at_k",
        margin=0.0,
    )
    request = ReviewRequest(
        refresh_id=pending.refresh_id,
        name="nightly",
        flow_run_id="flow-run-7",
        timeout_s=60,
        deadline=datetime(2026, 1, 3, tzinfo=timezone.utc),
        changes=[],
        pending=pending,
        config_json="{}",
    )
    store.write_stage(request.refresh_id, 0, "review_request", {ReviewRequest: [request]})
    assert store.review_of_flow_run("flow-run-7") == "nightly-2026-01-02"
    assert store.review_of_flow_run("flow-run-8") is None
    assert store.records(ReviewRequest, request.refresh_id) == [request]
