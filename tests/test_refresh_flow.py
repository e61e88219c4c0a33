"""The nightly refresh end to end under the Prefect test harness, against the scripted world over HTTP: no new
data, a promotion, idempotent dates, the next refresh starting from the promoted library, and a rejection."""

import asyncio
import os
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
import yaml

from application.cli import main
from clgrpo.experience.library import ExperienceLibrary
from clgrpo.storage.state import remember_db
from clgrpo.storage.store import Store
from clgrpo.testing.fake_openai import FakeOpenAIServer, Fault, role_of
from clgrpo.testing.scripted_llm import ScriptedWorld, make_problems, write_jsonl
from flows.refresh import overall_verdict, refresh, refresh_date
from schemas.records import EvalComparison
from schemas.refresh_config import RefreshConfig

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_harness")]

NIGHT = datetime(2026, 11, 21, 2, 0, tzinfo=timezone.utc)


def arrive(path, problems, moment: datetime):
    write_jsonl(problems, path)
    os.utime(path, (moment.timestamp(), moment.timestamp()))


def refresh_config(server: FakeOpenAIServer, tmp_path, **extra) -> RefreshConfig:
    heldout = write_jsonl(make_problems(n_per_family=4, seed=99), tmp_path / "heldout.jsonl")
    (tmp_path / "incoming").mkdir(exist_ok=True)
    model = {
        "model": "scripted",
        "base_url": server.base_url,
        "api_key_env": None,
        "max_tokens": 256,
        "retry_base_delay_s": 0.01,
        "retry_max_delay_s": 0.05,
        "timeout_s": 10,
    }
    return RefreshConfig.model_validate(
        {
            "name": "nightly",
            "source": {"kind": "directory", "path": str(tmp_path / "incoming")},
            "training": {
                "db_path": str(tmp_path / "refresh.duckdb"),
                "policy": model,
                "concurrency": 8,
                "grpo": {"group_size": 4, "epochs": 2, "batch_size": 16, "rollout_chunk_size": 8},
                # the refresh's own gate is what these tests are about: its training runs ungated
                "learning": {
                    "consolidate_chunk_size": 3,
                    "summarize_chunk_size": 4,
                    "library_gate": {"enabled": False},
                },
            },
            "evaluation": {"dataset": {"path": str(heldout)}, "k": 4, "bootstrap_samples": 500, "chunk_size": 8},
            "steps": 2,
            **extra,
        }
    )


def rows(db: str, sql: str) -> list[tuple]:
    with Store(db, read_only=True) as store:
        return [tuple(r) for r in store.query(sql).itertuples(index=False)]


async def test_no_new_data_then_a_promotion_then_idempotent_dates(tmp_path):
    world = ScriptedWorld(seed=11)
    with FakeOpenAIServer(world) as server:
        config = refresh_config(server, tmp_path)
        db = config.training.db_path

        # night 1: nothing has arrived: nothing trained, and that is recorded
        quiet = await refresh(config, as_of=NIGHT)
        assert quiet.status == "no_new_data" and quiet.n_new_problems == 0 and quiet.baseline_ref == "none"
        assert "no new problems arrived" in quiet.reasons[0]
        assert server.stats.requests == 0

        # night 2: twelve problems arrived during the day; one arrives after the cutoff and waits
        arrive(tmp_path / "incoming" / "day2.jsonl", make_problems(n_per_family=3, seed=5), NIGHT + timedelta(hours=12))
        arrive(
            tmp_path / "incoming" / "late.jsonl",
            make_problems(n_per_family=1, seed=6),
            NIGHT + timedelta(days=1, hours=3),
        )
        night2 = NIGHT + timedelta(days=1)
        promoted = await refresh(config, as_of=night2)
        assert promoted.status == "promoted", promoted.reasons
        assert promoted.refresh_id == "nightly-2026-11-22" and promoted.n_new_problems == 12
        assert promoted.baseline_ref == "none" and promoted.candidate_ref == "nightly-2026-11-22-train:2"
        assert promoted.ci_low > 0 and promoted.diff > 0.3 and promoted.metric == "mean_at_k"
        assert "lower bound is above the margin" in " ".join(promoted.reasons)
        requests = server.stats.requests

        # the same date again: the stored decision, nothing sampled, nothing written
        again = await refresh(config, as_of=night2 + timedelta(hours=5))
        assert again == promoted and server.stats.requests == requests

        exported = ExperienceLibrary.load(tmp_path / "refresh" / "nightly" / "promoted.seed.json")
        with Store(db, read_only=True) as store:
            learned = store.load_library("nightly-2026-11-22-train", 2)
            assert exported.as_dict() == learned.as_dict() and exported.next_id == learned.next_id
            taken = store.records("refresh_inputs", "nightly-2026-11-22")
            assert len(taken) == 12 and {t.source for t in taken} == {"day2.jsonl"}
            evaluation = store.records("evaluations", "nightly-2026-11-22-eval")
            assert [e.condition for e in evaluation] == ["none", "nightly-2026-11-22-train:2"]

        # night 3: only the late file is new; training starts from the promoted library, ids kept
        night3 = await refresh(config, as_of=night2 + timedelta(days=1))
        assert night3.n_new_problems == 4 and night3.baseline_ref == "nightly-2026-11-22-train:2"
        with Store(db, read_only=True) as store:
            start = store.load_library("nightly-2026-11-23-train", 0)
            assert start.as_dict() == learned.as_dict() and start.next_id == learned.next_id
            decisions = store.refresh_decisions("nightly")
        assert [d.refresh_date for d in decisions] == ["2026-11-21", "2026-11-22", "2026-11-23"]
        assert night3.status in {"promoted", "not_promoted"} and night3.reasons

    counts = rows(db, "SELECT refresh_id, count(*) FROM refreshes GROUP BY refresh_id ORDER BY refresh_id")
    assert counts == [("nightly-2026-11-21", 1), ("nightly-2026-11-22", 1), ("nightly-2026-11-23", 1)]


async def test_a_gain_below_the_margin_is_not_promoted(tmp_path):
    with FakeOpenAIServer(ScriptedWorld(seed=12)) as server:
        config = refresh_config(server, tmp_path, margin=0.95, name="strict", timezone="Europe/Berlin")
        arrive(tmp_path / "incoming" / "batch.jsonl", make_problems(n_per_family=3, seed=8), NIGHT - timedelta(hours=3))
        late_evening = datetime(2026, 11, 21, 23, 30, tzinfo=timezone.utc)  # already the 22nd in Berlin
        assert refresh_date(config, late_evening) == "2026-11-22"
        decision = await refresh(config, as_of=late_evening)
    assert decision.refresh_id == "strict-2026-11-22"
    assert decision.status == "not_promoted" and decision.diff > 0
    assert decision.ci_low <= 0.95 and "not above the margin +0.950" in decision.reasons[-1]
    assert not (tmp_path / "refresh" / "strict" / "promoted.json").exists()
    with Store(config.training.db_path, read_only=True) as store:
        assert not [d for d in store.refresh_decisions("strict") if d.promoted]
        # its problems are taken: a later refresh does not train on them again
        assert len(store.consumed_problem_keys("strict")) == 12


async def test_a_failed_refresh_resumes_on_the_same_problems_without_repeating_stages(tmp_path):
    world = ScriptedWorld(seed=13)
    with FakeOpenAIServer(world) as server:
        config = refresh_config(server, tmp_path, steps=1)
        arrive(tmp_path / "incoming" / "a.jsonl", make_problems(n_per_family=2, seed=3), NIGHT - timedelta(hours=2))
        server.inject(Fault(kind="status", status=400, times=1, match=lambda r: role_of(r) == "library consolidator"))
        with pytest.raises(Exception, match="400"):
            await refresh(config, as_of=NIGHT)
        with Store(config.training.db_path, read_only=True) as store:
            assert store.refresh_decisions("nightly") == []
            assert len(store.records("refresh_inputs", "nightly-2026-11-21")) == 8
        rollouts_before = server.stats.by_role["policy"]
        # a file that lands before the cutoff but after the refresh took its problems waits for the next date
        arrive(tmp_path / "incoming" / "b.jsonl", make_problems(n_per_family=1, seed=4), NIGHT - timedelta(hours=1))

        decision = await refresh(config, as_of=NIGHT)
        assert decision.n_new_problems == 8 and decision.status in {"promoted", "not_promoted"}
        # the resumed training did not sample its rollouts again (only the evaluation's policy calls were new)
        heldout_requests = 2 * 16  # two conditions x 16 held-out problems, k samples per request
        assert server.stats.by_role["policy"] - rollouts_before == heldout_requests
        nxt = await refresh(config, as_of=NIGHT + timedelta(days=1))
        assert nxt.n_new_problems == 4
    with Store(config.training.db_path, read_only=True) as store:
        assert rows_of(store, "SELECT count(*) FROM rollouts WHERE run_id = 'nightly-2026-11-21-train'") == [(32,)]


def rows_of(store: Store, sql: str) -> list[tuple]:
    return [tuple(r) for r in store.query(sql).itertuples(index=False)]


@pytest.mark.usefixtures("prefect_harness")
def test_refresh_from_the_command_line(tmp_path, capsys):
    with FakeOpenAIServer(ScriptedWorld(seed=14)) as server:
        config = refresh_config(server, tmp_path, name="cli")
        path = tmp_path / "refresh.yaml"
        path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
        assert main(["refresh", "run", "--config", str(path), "--as-of", "2026-11-21T02:00"]) == 0
        assert "cli-2026-11-21: no_new_data (0 new problems)" in capsys.readouterr().out
        assert main(["refresh", "history", "--name", "cli", "--db", config.training.db_path]) == 0
        out = capsys.readouterr().out
        assert "started from none" in out and "no new problems arrived" in out
        # without --db: the database that holds the refresh, not the most recent one (here a demo's)
        with Store(str(tmp_path / "demo.duckdb")):
            pass
        remember_db(tmp_path / "demo.duckdb")
        assert main(["refresh", "history", "--name", "cli"]) == 0
        assert "no new problems arrived" in capsys.readouterr().out
        assert main(["refresh", "run", "--config", str(path), "--as-of", "tomorrow"]) == 2
        assert "use an ISO date-time" in capsys.readouterr().err


async def test_without_as_of_the_date_is_the_runs_scheduled_start(tmp_path):
    with FakeOpenAIServer(ScriptedWorld(seed=15)) as server:
        config = refresh_config(server, tmp_path, name="sched", timezone="Asia/Tokyo")
        today = {datetime.now(ZoneInfo("Asia/Tokyo")).date().isoformat()}
        decision = await refresh(config)
        today.add(datetime.now(ZoneInfo("Asia/Tokyo")).date().isoformat())
    assert decision.refresh_date in today and decision.refresh_id == f"sched-{decision.refresh_date}"
    assert abs((decision.cutoff - datetime.now(timezone.utc)).total_seconds()) < 120


@pytest.mark.parametrize(
    ("ci_low", "margin", "promoted"), [(0.01, 0.0, True), (0.0, 0.0, False), (-0.2, -0.25, True), (0.04, 0.05, False)]
)
def test_promotion_needs_the_ci_lower_bound_above_the_margin(ci_low, margin, promoted):
    comparison = EvalComparison(
        eval_id="e",
        baseline="none",
        candidate="c:1",
        metric="pass_at_k",
        baseline_value=0.4,
        candidate_value=0.5,
        diff=0.1,
        ci_low=ci_low,
        ci_high=0.3,
        ci_level=0.9,
        n_problems=30,
    )
    decision, reason = overall_verdict(comparison, margin)
    assert decision is promoted
    assert reason.startswith("Pass@k 0.400 -> 0.500 on 30 held-out problems: gain +0.100, 90% CI")
    assert ("is above the margin" in reason) is promoted


async def test_a_flow_run_records_its_database_for_later_commands(tmp_path, monkeypatch, capsys):
    """A refresh run by a worker (the flow itself, no CLI around it): `refresh history` without --db, from
    another directory, finds its database, as it does for a CLI run."""
    monkeypatch.setenv("CLGRPO_STATE_DIR", str(tmp_path / "state"))
    with FakeOpenAIServer(ScriptedWorld(seed=14)) as server:
        config = refresh_config(server, tmp_path, name="deployed")
        await refresh(config, as_of=NIGHT)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert await asyncio.to_thread(main, ["refresh", "history", "--name", "deployed"]) == 0
    assert "deployed-2026-11-21: no_new_data" in capsys.readouterr().out
