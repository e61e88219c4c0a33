"""The per-task no-regression gate of the nightly refresh: the verdict rule, the gate table, and refreshes under
the Prefect test harness against scripted worlds over HTTP, with task tags on the held-out set."""

from __future__ import annotations

import json
import random
from datetime import datetime, timedelta, timezone

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

from application.cli import main
from clgrpo.refresh.promotion import promotion_gate, tag_verdict
from clgrpo.storage.store import FrameValidationError, Store
from clgrpo.testing.fake_openai import ChatRequest, FakeOpenAIServer
from clgrpo.testing.scripted_llm import FAMILIES, ScriptedWorld, find_problem, make_problems, write_jsonl
from flows.refresh import refresh
from schemas.records import EvalComparison
from schemas.refresh_config import RefreshConfig
from tests.test_refresh_flow import arrive, refresh_config

NIGHT = datetime(2026, 11, 21, 2, 0, tzinfo=timezone.utc)
HURT = "sums"


# --- the rule ---------------------------------------------------------------------------------------------------
def comparison(
    tag: str | None, diff: float, low: float, high: float, n: int = 12, metric: str = "mean_at_k"
) -> EvalComparison:
    return EvalComparison(
        eval_id="e",
        baseline="none",
        candidate="c:1",
        metric=metric,
        baseline_value=0.62,
        candidate_value=round(0.62 + diff, 6),
        diff=diff,
        ci_low=low,
        ci_high=high,
        ci_level=0.95,
        n_problems=n,
        tag=tag,
    )


@pytest.mark.parametrize(
    ("high", "n", "tag_margin", "verdict"),
    [
        (-0.01, 12, 0.0, "fail"),  # the whole CI below 0
        (0.0, 12, 0.0, "pass"),  # touching 0 is not below it
        (0.2, 12, 0.0, "pass"),
        (-0.04, 12, 0.05, "pass"),  # within the tolerated loss
        (-0.05, 12, 0.05, "pass"),  # exactly at -tag_margin: not below
        (-0.06, 12, 0.05, "fail"),
        (-0.5, 9, 0.0, "not_gated"),  # too few problems: reported, never failed
        (-0.5, 10, 0.0, "fail"),  # exactly min_tag_problems is gated
    ],
)
def test_a_tag_fails_when_its_ci_upper_bound_is_below_minus_the_tag_margin(high, n, tag_margin, verdict):
    assert tag_verdict(comparison("geometry", high - 0.1, high - 0.2, high, n=n), tag_margin, 10) == verdict


def gate_config(**extra) -> RefreshConfig:
    return RefreshConfig.model_validate(
        {"source": {"path": "in"}, "training": {}, "evaluation": {"dataset": {"path": "h.jsonl"}}, **extra}
    )


def test_the_gate_names_every_failing_tag_with_its_numbers():
    comparisons = [
        comparison(None, 0.2, 0.05, 0.35, n=40),
        comparison(None, 0.9, 0.8, 1.0, metric="pass_at_k"),
        comparison("web", -0.4, -0.6, -0.25, n=3),
        comparison("geometry", -0.21, -0.33, -0.09),
        comparison("algebra", 0.3, 0.1, 0.5),
        comparison("geometry", 0.1, 0.0, 0.2, metric="pass_at_k"),
        comparison("probability", -0.3, -0.5, -0.1, n=11),
    ]
    gate = promotion_gate("r", comparisons, gate_config(min_tag_problems=10))
    assert [(r.tag, r.verdict) for r in gate.rows] == [
        (None, "pass"),
        ("algebra", "pass"),
        ("geometry", "fail"),
        ("probability", "fail"),
        ("web", "not_gated"),
    ]
    assert all(r.metric == "mean_at_k" and r.refresh_id == "r" for r in gate.rows)
    assert [r.threshold for r in gate.rows] == [0.0, 0.0, 0.0, 0.0, 0.0] and str(gate.rows[1].threshold) == "0.0"
    assert not gate.tags_pass and [r.tag for r in gate.failing_tags] == ["geometry", "probability"]
    assert gate.reasons() == [
        "per-tag gate: 2 of 3 gated tag(s) regressed (geometry, probability): not promoted",
        "tag geometry: 0.620 -> 0.410, diff -0.210 [-0.330, -0.090] on 12 problems: wholly below 0",
        "tag probability: 0.620 -> 0.320, diff -0.300 [-0.500, -0.100] on 11 problems: wholly below 0",
        "tags not gated, fewer than 10 held-out problems each (min_tag_problems): web (3)",
    ]
    tolerant = promotion_gate("r", comparisons, gate_config(tag_margin=0.2, min_tag_problems=3))
    assert [(r.tag, r.verdict) for r in tolerant.failing_tags] == [("web", "fail")]
    assert tolerant.reasons()[1].endswith("[-0.600, -0.250] on 3 problems: wholly below -0.200")
    assert tolerant.rows[0].threshold == 0.0 and tolerant.rows[1].threshold == -0.2


def test_without_tags_the_gate_is_the_overall_rule_alone():
    failing = promotion_gate("r", [comparison(None, 0.1, -0.01, 0.2)], gate_config())
    assert [(r.tag, r.verdict) for r in failing.rows] == [(None, "fail")]
    assert failing.tags_pass and failing.reasons() == []  # the overall rule speaks for itself (flows.refresh.decide)
    passing = promotion_gate("r", [comparison(None, 0.1, 0.06, 0.2)], gate_config(margin=0.05))
    assert passing.rows[0].verdict == "pass" and passing.rows[0].reason == "lower bound above the margin +0.050"


def test_the_gate_table_refuses_verdicts_that_break_the_rule(tmp_path):
    gate = promotion_gate(
        "r", [comparison(None, 0.2, 0.05, 0.35), comparison("geometry", -0.21, -0.33, -0.09)], gate_config()
    )
    with Store(tmp_path / "db.duckdb") as store:
        store.write_stage("r", 0, "refresh-gate", {"refresh_gate": gate.rows})
        assert store.records("refresh_gate", "r", 0, "refresh-gate") == gate.rows
        forged = [gate.rows[0], gate.rows[1].model_copy(update={"verdict": "pass"})]
        with pytest.raises(FrameValidationError, match="verdicts_follow_the_rule"):
            store.write_stage("r", 0, "refresh-gate", {"refresh_gate": forged})
        with pytest.raises(FrameValidationError, match="one_row_per_tag"):
            store.write_stage("r", 0, "refresh-gate", {"refresh_gate": gate.rows + gate.rows[1:]})


# --- refreshes end to end ----------------------------------------------------------------------------------------
class OneFamilyHurt(ScriptedWorld):
    """The scripted world, except that the ``hurt`` family is easy (right with ``p_hurt``) until another family's
    lesson is in the prompt: then the policy always gets it wrong. Learning the other families' lessons helps
    overall and hurts that one family."""

    def __init__(self, seed: int, hurt: str = HURT, p_hurt: float = 0.6) -> None:
        super().__init__(seed=seed)
        self.hurt, self.p_hurt = hurt, p_hurt

    def _direct(self, request: ChatRequest, rng: random.Random) -> str:
        found = next((p for m in reversed(request.messages) if (p := find_problem(m["content"]))), None)
        if found is None or found[0].name != self.hurt:
            return super()._direct(request, rng)
        family, a, b = found
        prompt = "\n".join(m["content"] for m in request.messages).casefold()
        confused = any(f.key.casefold() in prompt for f in FAMILIES if f is not family)
        truth = family.compute(a, b)
        value = truth if not confused and rng.random() < self.p_hurt else truth + 1
        return f"We need {a} {family.symbol} {b}. Working it out gives {value}. The answer is \\boxed{{{value}}}."


def tagged_heldout(path, per_family: dict[str, int]) -> str:
    """Held-out problems tagged with their family (``tag`` column), ``per_family`` problems of each."""
    rows = [
        {**row, "tag": row["id"].split("-")[0]} for row in make_problems(n_per_family=max(per_family.values()), seed=99)
    ]
    kept = [r for r in rows if int(r["id"].split("-")[1]) < per_family[r["tag"]]]
    return str(write_jsonl(kept, path))


def gated_config(server: FakeOpenAIServer, tmp_path, per_family: dict[str, int] | None, **extra) -> RefreshConfig:
    config = refresh_config(server, tmp_path, **extra)
    if per_family is None:
        return config
    evaluation = config.evaluation.model_copy(
        update={
            "dataset": config.evaluation.dataset.model_copy(
                update={"path": tagged_heldout(tmp_path / "tagged.jsonl", per_family)}
            )
        }
    )
    return config.model_copy(update={"evaluation": evaluation})


async def refresh_once(config: RefreshConfig, tmp_path):
    arrive(tmp_path / "incoming" / "day.jsonl", make_problems(n_per_family=3, seed=5), NIGHT - timedelta(hours=3))
    return await refresh(config, as_of=NIGHT)


def gate_rows(config: RefreshConfig, refresh_id: str) -> list:
    with Store(config.training.db_path, read_only=True) as store:
        return store.records("refresh_gate", refresh_id, 0, "refresh-gate")


async def latest_artifact(key: str):
    async with get_client() as client:
        artifacts = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    return max(artifacts, key=lambda a: a.created).data


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_a_candidate_that_helps_overall_but_hurts_a_tag_is_not_promoted(tmp_path, capsys):
    with FakeOpenAIServer(OneFamilyHurt(seed=21)) as server:
        config = gated_config(server, tmp_path, {f.name: 6 for f in FAMILIES}, min_tag_problems=4)
        decision = await refresh_once(config, tmp_path)
    assert decision.status == "not_promoted", decision.reasons
    assert decision.ci_low > config.margin and decision.diff > 0.2  # the overall gate alone would promote it
    assert "lower bound is above the margin" in decision.reasons[1]
    assert decision.reasons[2] == f"per-tag gate: 1 of 4 gated tag(s) regressed ({HURT}): not promoted"
    assert decision.reasons[3].startswith(f"tag {HURT}: ") and decision.reasons[3].endswith(
        "on 6 problems: wholly below 0"
    )
    assert not (tmp_path / "refresh" / "nightly" / "promoted.json").exists()

    rows = gate_rows(config, decision.refresh_id)
    assert [(r.tag, r.verdict) for r in rows] == [
        (None, "pass"),
        ("differences", "pass"),
        ("products", "pass"),
        ("remainders", "pass"),
        (HURT, "fail"),
    ]
    hurt = rows[-1]
    assert hurt.n_problems == 6 and hurt.ci_high < 0 and hurt.candidate_value == 0.0 and hurt.baseline_value > 0.3
    assert (rows[0].diff, rows[0].ci_low, rows[0].n_problems) == (decision.diff, decision.ci_low, 24)
    with Store(config.training.db_path, read_only=True) as store:  # the evaluation's per-tag comparisons
        compared = store.records("eval_comparisons", decision.eval_id)
    assert {c.tag for c in compared} == {None, *(f.name for f in FAMILIES)} and len(compared) == 10

    table = json.loads(await latest_artifact("nightly-refresh-gate"))
    assert [(r["tag"], r["problems"], r["verdict"]) for r in table] == [
        ("all", "24", "pass"),
        ("differences", "6", "pass"),
        ("products", "6", "pass"),
        ("remainders", "6", "pass"),
        (HURT, "6", "fail"),
    ]
    markdown = await latest_artifact("nightly-refresh")
    assert "## Promotion gate (Mean@k, overall and per task tag)" in markdown and "| sums | 6 |" in markdown
    history = json.loads(await latest_artifact("nightly-refresh-history"))
    assert history[-1]["failing tags"].startswith(f"{HURT} -")

    assert main(["refresh", "history", "--name", "nightly", "--db", config.training.db_path]) == 0
    headline = capsys.readouterr().out.splitlines()[0]
    assert headline.startswith("2026-11-21  nightly-2026-11-21: not_promoted (12 new problems, gain +")
    assert f"failing tags: {HURT} -" in headline


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_a_candidate_that_hurts_no_tag_is_promoted_with_passing_rows(tmp_path):
    with FakeOpenAIServer(ScriptedWorld(seed=22)) as server:
        config = gated_config(server, tmp_path, {f.name: 4 for f in FAMILIES}, min_tag_problems=4)
        decision = await refresh_once(config, tmp_path)
    assert decision.status == "promoted", decision.reasons
    assert decision.reasons[2] == (
        "per-tag gate: none of 4 gated tag(s) regressed (differences, products, remainders, sums)"
    )
    rows = gate_rows(config, decision.refresh_id)
    assert [r.tag for r in rows] == [None, "differences", "products", "remainders", "sums"]
    assert {r.verdict for r in rows} == {"pass"} and all(r.n_problems == 4 for r in rows[1:])
    assert (tmp_path / "refresh" / "nightly" / "promoted.json").exists()


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_tags_with_too_few_problems_are_reported_not_gated(tmp_path):
    with FakeOpenAIServer(OneFamilyHurt(seed=23)) as server:
        per_family = {f.name: 6 for f in FAMILIES} | {HURT: 2}
        config = gated_config(server, tmp_path, per_family, min_tag_problems=4)
        decision = await refresh_once(config, tmp_path)
    rows = gate_rows(config, decision.refresh_id)
    hurt = next(r for r in rows if r.tag == HURT)
    assert hurt.verdict == "not_gated" and hurt.n_problems == 2 and hurt.diff < 0
    assert hurt.reason == "not gated: fewer than 4 held-out problems (min_tag_problems)"
    assert decision.status == "promoted", decision.reasons  # its regression does not block the promotion
    assert decision.reasons[-1] == f"tags not gated, fewer than 4 held-out problems each (min_tag_problems): {HURT} (2)"


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_a_held_out_set_without_tags_is_gated_as_before(tmp_path):
    with FakeOpenAIServer(ScriptedWorld(seed=24)) as server:
        config = gated_config(server, tmp_path, None)
        decision = await refresh_once(config, tmp_path)
    assert decision.status == "promoted" and len(decision.reasons) == 2  # no per-tag lines
    rows = gate_rows(config, decision.refresh_id)
    assert [(r.tag, r.verdict, r.n_problems, r.threshold) for r in rows] == [(None, "pass", 16, 0.0)]
    assert (rows[0].diff, rows[0].ci_low, rows[0].ci_high) == (decision.diff, decision.ci_low, decision.ci_high)
    with Store(config.training.db_path, read_only=True) as store:
        assert {c.tag for c in store.records("eval_comparisons", decision.eval_id)} == {None}
    markdown = await latest_artifact("nightly-refresh")
    assert "| all | 16 |" in markdown
