"""The work journal: append-only, tied to one database file, never holding failed items."""

from __future__ import annotations

import pytest

from clgrpo.storage.journal import RunJournal, StageItems, recording, sample_key
from clgrpo.storage.store import Store
from clgrpo.testing.fake_openai import FakeOpenAIServer, Fault, match_roles
from clgrpo.testing.scripted_llm import ScriptedWorld
from flows.train import train
from schemas.records import LLMCall, Rollout, Turn
from tests.test_reliability import journal_dirs, make_config


def rollout(i: int) -> Rollout:
    return Rollout(
        problem_id="p",
        sample_idx=i,
        prompt_hash="h",
        library_version=0,
        turns=[Turn(kind="assistant", content=f"answer {i}")],
    )


def test_calls_and_items_survive_reopening_and_a_line_cut_by_a_kill(tmp_path):
    journal = RunJournal(tmp_path / "run").step(3)
    with recording(journal, stage="rollout"):
        StageItems("rollout", Rollout).put(sample_key("p", 0), rollout(0))
        journal.add_call(LLMCall(stage="rollout", role="policy", model="m", call_id="c1"))
    journal.close()
    with open(journal.path, "ab") as handle:  # a kill in the middle of a write
        handle.write(b'{"t":"item","stage":"rollout","key":"p#1","rec')
    again = RunJournal(tmp_path / "run").step(3)
    assert again.get("rollout", "p#0", Rollout) == rollout(0)
    assert again.get("rollout", "p#1", Rollout) is None  # the cut line is dropped, its work redone
    assert [c.call_id for c in again.calls("rollout")] == ["c1"]
    again.add_call(LLMCall(stage="rollout", role="policy", model="m", call_id="c2"))
    again.close()
    assert [c.call_id for c in RunJournal(tmp_path / "run").step(3).calls("rollout")] == ["c1", "c2"]


def test_items_are_only_used_inside_a_recording_that_allows_them(tmp_path):
    journal = RunJournal(tmp_path / "run").step(1)
    journal.put("rollout", "p#0", rollout(0))
    assert StageItems("rollout", Rollout).get("p#0") is None  # no active journal
    with recording(journal):
        assert StageItems("rollout", Rollout).get("p#0") == rollout(0)
    with recording(journal, items=False):  # e.g. validation: calls only
        assert StageItems("rollout", Rollout).get("p#0") is None


def test_a_re_created_database_gets_a_new_identity(tmp_path):
    path = tmp_path / "a.duckdb"
    with Store(path) as store:
        first = store.db_id
    with Store(path) as store:
        assert store.db_id == first  # stable for the file
    path.unlink()
    with Store(path) as store:
        assert store.db_id != first


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_a_rerun_into_a_fresh_database_recomputes_instead_of_replaying(tmp_path):
    with FakeOpenAIServer(ScriptedWorld(seed=5)) as server:
        cfg = make_config(server, tmp_path, "fresh", n_per_family=1, epochs=1, max_retries=0)
        # the learner is down: rollouts are stored, summarize fails over its tolerance
        server.inject(Fault(kind="status", status=503, rate=1.0, match=match_roles("trajectory summarizer")))
        with pytest.raises(Exception, match="summarize"):
            await train(cfg)
        assert journal_dirs(cfg)  # kept for a resume
        first_policy = server.stats.by_role["policy"]

        for suffix in ("", ".wal"):  # the database is deleted (or lost); the endpoint is fixed
            (tmp_path / f"runs.duckdb{suffix}").unlink(missing_ok=True)
        server.clear_faults()
        server.reset_stats()
        result = await train(cfg)
        second_policy = server.stats.by_role["policy"]
    assert [r.step for r in result.steps] == [1]
    assert first_policy > 0 and second_policy == first_policy  # sampled again: nothing replayed from elsewhere
    with Store(cfg.db_path, read_only=True) as store:
        calls = store.records("llm_calls", "fresh")
    assert all(c.ok for c in calls)  # no failed call of the old database resurfaced
    assert not journal_dirs(cfg)


def test_runs_delete_removes_the_run_journal(tmp_path, capsys):
    from application.cli import main

    db = tmp_path / "d.duckdb"
    with Store(db) as store:
        store.con.execute(
            "INSERT INTO runs (run_id, fingerprint, config_json, created_at) VALUES ('r1', 'f', '{}', now())"
        )
        journal = RunJournal.open(db, store.db_id, "r1")
    journal.step(1).put("rollout", "p#0", rollout(0))
    journal.close()
    assert journal.root.is_dir()
    assert main(["runs", "delete", "r1", "--db", str(db), "--yes"]) == 0
    assert not journal.root.exists()
    assert "work files" in capsys.readouterr().out


def test_an_unreadable_line_in_the_middle_is_counted(tmp_path):
    journal = RunJournal(tmp_path / "run").step(1)
    journal.put("rollout", "p#0", rollout(0))
    journal.close()
    with open(journal.path, "ab") as handle:
        handle.write(b"not json\n")
    again = RunJournal(tmp_path / "run").step(1)
    again.put("rollout", "p#1", rollout(1))
    assert again.unreadable_lines == 1 and again.get("rollout", "p#0", Rollout) == rollout(0)
