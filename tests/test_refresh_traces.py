"""A nightly refresh on production traces, end to end against the scripted world over HTTP: feedback answers
and rewards by source, skipped rows in the decision, no secret reaching the model or the store, the watermark
across nights, and a failed traces refresh that leaves the promoted library as it was."""

import json
import os
from datetime import timedelta

import pytest

from clgrpo.storage.store import Store
from clgrpo.testing.fake_openai import FakeOpenAIServer, Fault, role_of
from clgrpo.testing.scripted_llm import ScriptedWorld, make_problems
from flows.refresh import refresh
from tests.test_refresh_flow import NIGHT, refresh_config, rows

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_harness")]

SECRET = "sk-proj-Qwertyuiopasdfgh123456"


class RecordingWorld(ScriptedWorld):
    """The scripted world, keeping every request's messages (to look for secrets in them)."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed=seed)
        self.seen: list[str] = []

    def __call__(self, request):
        self.seen.append(json.dumps(request.messages))
        return super().__call__(request)


def traces_of(problems: list[dict], start, step=timedelta(minutes=1)) -> list[dict]:
    """Conversations about the problems: every third with a reference, every third thumbs up, the rest none."""
    out = []
    for i, p in enumerate(problems):
        row = {
            "id": f"tr-{p['id']}",
            "created_at": (start + i * step).isoformat(),
            "tag": p["id"].split("-")[0],
            "messages": [{"role": "user", "content": p["problem"]}],
            "reply": f"\\boxed{{{p['answer']}}}",
        }
        if i % 3 == 0:
            row["feedback"] = {"thumbs": -1, "reference": p["answer"]}
        elif i % 3 == 1:
            row["feedback"] = {"thumbs": "up"}
        out.append(row)
    return out


def land(path, rows: list, moment) -> None:
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    os.utime(path, (moment.timestamp(), moment.timestamp()))


async def test_traces_refresh_over_two_nights(tmp_path):
    world = RecordingWorld(seed=21)
    with FakeOpenAIServer(world) as server:
        config = refresh_config(server, tmp_path, name="prod")
        config = config.model_copy(update={"source": config.source.model_copy(update={"kind": "traces"})})
        db = config.training.db_path
        incoming = tmp_path / "incoming"
        day1 = traces_of(make_problems(n_per_family=3, seed=5), NIGHT - timedelta(hours=10))
        day1[4]["messages"][0]["content"] += f" (my key is {SECRET})"
        land(
            incoming / "day1.jsonl",
            [*day1, "{broken\n", {"messages": [{"role": "system", "content": "x"}]}],
            NIGHT - timedelta(hours=1),
        )

        first = await refresh(config, as_of=NIGHT)
        assert first.status == "promoted" and first.n_new_problems == 12, first.reasons
        assert any(
            r.startswith("2 trace row(s) skipped: day1.jsonl:13: not JSON") and "day1.jsonl:14: no user message" in r
            for r in first.reasons
        )
        assert "1 secret(s) redacted from the traces" in first.reasons
        assert not any(SECRET in body for body in world.seen)
        with Store(db, read_only=True) as store:
            taken = store.records("refresh_inputs", first.refresh_id)
            assert not any(SECRET in t.problem for t in taken)
            assert [t.answer_source for t in taken[:3]] == ["reference", "thumbs_up_reply", "none"]
            assert taken[0].rejected_answer == taken[0].answer and taken[0].tag == "sums"
            rejects = store.records("refresh_rejects", first.refresh_id)
            assert [(r.file, r.line) for r in rejects] == [("day1.jsonl", 13), ("day1.jsonl", 14)]
            problems = store.records("problems", f"{first.refresh_id}-train")
            assert {p.tag for p in problems} == {"sums", "products", "differences", "remainders"}
        sources = dict(
            rows(
                db,
                "SELECT reward_source, count(*) FROM rewards WHERE run_id = 'prod-2026-11-21-train' "
                "AND reward IS NOT NULL GROUP BY 1",
            )
        )
        assert set(sources) == {"feedback:reference", "feedback:thumbs_up"}
        assert rows(
            db,
            "SELECT count(*) FROM rewards WHERE run_id = 'prod-2026-11-21-train' AND reward IS NULL "
            "AND reward_source IS NOT NULL",
        ) == [(0,)]
        mark = rows(db, "SELECT watermark FROM refresh_watermarks WHERE run_id = 'prod-2026-11-21'")[0][0]
        # the newest usable row's time: the broken lines "arrive" at their file's time (NIGHT - 1 h), which must
        # not move the watermark past rows logged later with an earlier time
        assert mark == NIGHT - timedelta(hours=10) + 11 * timedelta(minutes=1)

        # night 2: the file grew (old rows, four new ones, and two rows logged late with earlier times: one after
        # the broken lines' file time, one even before the first night's watermark); the first attempt fails
        day2 = traces_of(make_problems(n_per_family=1, seed=6), NIGHT + timedelta(hours=8))
        late = traces_of(make_problems(n_per_family=2, seed=7)[:2], NIGHT - timedelta(hours=2))
        late[1]["created_at"] = (NIGHT - timedelta(hours=11)).isoformat()
        for i, row in enumerate(late):
            row["id"] = f"late-{i}"
        land(incoming / "day1.jsonl", [*day1, *day2, *late], NIGHT + timedelta(hours=20))
        server.inject(Fault(kind="status", status=400, rate=1.0, match=lambda r: role_of(r) == "policy"))
        night2 = NIGHT + timedelta(days=1)
        with pytest.raises(Exception):  # noqa: B017 - every rollout fails: the training stage fails
            await refresh(config.model_copy(update={"steps": 1}), as_of=night2)
        server.clear_faults()
        with Store(db, read_only=True) as store:
            promoted = [d for d in store.refresh_decisions("prod") if d.promoted]
            assert [d.refresh_id for d in promoted] == ["prod-2026-11-21"]
            assert (tmp_path / "refresh" / "prod" / "promoted.seed.json").exists()
            retaken = store.records("refresh_inputs", "prod-2026-11-22")
        expected = [f"tr-{p['id']}" for p in make_problems(1, seed=6)] + [row["id"] for row in late]
        assert sorted(t.problem_id for t in retaken) == sorted(expected)  # the late rows too, none lost

        second = await refresh(config.model_copy(update={"steps": 1}), as_of=night2)
        assert second.n_new_problems == 6 and second.baseline_ref == first.candidate_ref
        assert not any("skipped" in r for r in second.reasons)  # the broken lines were reported on night 1
        assert any(r.startswith("1 trace row(s) arrived late (logged with a time before") for r in second.reasons)
