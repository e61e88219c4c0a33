"""The evaluation flow, validation during training, and reports, against the scripted world over HTTP.

The scripted policy is right with probability 0.2 without its family's lesson in the prompt and 0.9 with it.
"""

import threading
from collections import defaultdict

import pytest
import yaml

from application.cli import main
from clgrpo.experience.library import ExperienceLibrary
from clgrpo.inputs.leakage import LeakageError
from clgrpo.process.errors import EvaluationError
from clgrpo.storage.store import Store
from clgrpo.testing.fake_openai import ChatRequest, FakeOpenAIServer, role_of
from clgrpo.testing.scripted_llm import FAMILIES, ScriptedWorld, find_problem, make_problems, write_jsonl
from flows.evaluate import evaluate
from schemas.config import DatasetConfig, EvalConfig, ModelConfig, RunConfig

pytestmark = [pytest.mark.flow, pytest.mark.usefixtures("prefect_harness")]


class RecordingWorld(ScriptedWorld):
    """Remembers the temperature and seed of every policy request, by problem text."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.policy_requests: list[tuple[str, float | None, int | None]] = []
        self._record_lock = threading.Lock()

    def __call__(self, request: ChatRequest) -> list[str]:
        if role_of(request) == "policy":
            found = find_problem(request.messages[-1]["content"])
            with self._record_lock:
                self.policy_requests.append((str(found), request.temperature, request.seed))
        return super().__call__(request)


def model_config(server: FakeOpenAIServer, tmp_path, **extra) -> RunConfig:
    policy = ModelConfig(
        model="scripted",
        base_url=server.base_url,
        api_key_env=None,
        max_tokens=256,
        retry_base_delay_s=0.01,
        retry_max_delay_s=0.05,
        timeout_s=10,
        temperature=0.9,
    )
    return RunConfig(
        run_id="model",
        db_path=str(tmp_path / "eval.duckdb"),
        dataset=DatasetConfig(path=str(tmp_path / "unused.jsonl")),
        policy=policy,
        concurrency=8,
        **extra,
    )


def lessons_library(tmp_path) -> str:
    path = tmp_path / "lessons.json"
    ExperienceLibrary.from_mapping({f"G{i}": f.lesson for i, f in enumerate(FAMILIES)}).dump(path)
    return str(path)


async def test_library_with_the_lessons_beats_none_with_a_paired_ci(tmp_path):
    dataset = write_jsonl(make_problems(n_per_family=5, seed=21), tmp_path / "test.jsonl")
    evaluation = EvalConfig(
        dataset=DatasetConfig(path=str(dataset)), k=4, pass_k=2, bootstrap_samples=1000, chunk_size=6
    )
    # the four 95% intervals below each miss their true value in 5% of worlds (coverage itself is simulated in
    # tests/test_metrics.py); any change of prompt wording re-draws the world, so the seed is one where all hold
    world = RecordingWorld(seed=9)
    with FakeOpenAIServer(world) as server:
        cfg = model_config(server, tmp_path)
        outcome = await evaluate(cfg, evaluation, ["none", lessons_library(tmp_path)])
        assert not outcome.reused
        n_requests = len(world.policy_requests)
        again = await evaluate(cfg, evaluation, ["none", lessons_library(tmp_path)])
        assert again.reused and len(world.policy_requests) == n_requests  # read back, nothing sampled
        first_url = server.base_url
    with FakeOpenAIServer(world) as moved:  # the same model behind a restarted server: another port
        cfg = model_config(moved, tmp_path).model_copy(
            update={
                "policy": model_config(moved, tmp_path).policy.model_copy(update={"timeout_s": 99.0, "max_retries": 1})
            }
        )
        assert cfg.policy.base_url != first_url
        moved_again = await evaluate(cfg, evaluation, ["none", lessons_library(tmp_path)], eval_id=outcome.eval_id)
        assert moved_again.reused and len(world.policy_requests) == n_requests
        hotter = cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"max_tokens": 128})})
        with pytest.raises(EvaluationError, match="already holds a different evaluation"):
            await evaluate(hotter, evaluation, ["none", lessons_library(tmp_path)], eval_id=outcome.eval_id)

    none, lessons = outcome.summaries
    assert (none.condition, lessons.condition) == ("none", "lessons.json")
    assert none.n_problems == 20 and none.k == 4 and none.pass_k == 2 and none.temperature == 0.3
    # known accuracies: the CIs hold the scripted policy's true Mean@k and Pass@k
    assert none.mean_ci_low <= 0.2 <= none.mean_ci_high and lessons.mean_ci_low <= 0.9 <= lessons.mean_ci_high
    assert none.pass_ci_low <= 1 - 0.8**2 <= none.pass_ci_high
    # Pass@2 is 0.99: when all 20 problems pass (likely), a bootstrap interval collapses to [1, 1]
    assert lessons.pass_ci_low <= 1 - 0.1**2 <= lessons.pass_ci_high or lessons.pass_ci_low == 1.0
    mean_diff = next(c for c in outcome.comparisons if c.metric == "mean_at_k")
    assert (mean_diff.baseline, mean_diff.candidate) == ("none", "lessons.json")
    assert mean_diff.significant and mean_diff.ci_low > 0.4
    assert mean_diff.diff == pytest.approx(lessons.mean_at_k - none.mean_at_k)

    # the evaluation temperature, never the policy's own (0.9); the same seed per problem in both conditions
    assert {t for _, t, _ in world.policy_requests} == {0.3}
    seeds = defaultdict(set)
    for problem, _, seed in world.policy_requests[:n_requests]:
        seeds[problem].add(seed)
    assert len(seeds) == 20 and all(len(s) == 1 for s in seeds.values())

    with Store(cfg.db_path, read_only=True) as store:
        rows = store.query(
            "SELECT condition, count(*) AS n, count(DISTINCT seed) AS seeds FROM eval_results "
            "WHERE run_id = ? GROUP BY condition ORDER BY condition",
            [outcome.eval_id],
        )
        assert rows["n"].tolist() == [80, 80] and rows["seeds"].tolist() == [80, 80]
        assert len(store.records("evaluations", outcome.eval_id)) == 2
        calls = store.query(
            "SELECT stage, count(*) AS n FROM llm_calls WHERE run_id = ? GROUP BY stage", [outcome.eval_id]
        )
        assert calls["stage"].tolist() == ["evaluate"] and calls["n"][0] == n_requests


async def test_no_difference_is_reported_when_the_library_does_not_help(tmp_path):
    dataset = write_jsonl(make_problems(n_per_family=5, seed=22), tmp_path / "test.jsonl")
    useless = tmp_path / "useless.txt"
    useless.write_text("[U0]. Read the problem twice before answering.\n")
    evaluation = EvalConfig(dataset=DatasetConfig(path=str(dataset)), k=4, bootstrap_samples=1000)
    with FakeOpenAIServer(ScriptedWorld(seed=5)) as server:
        outcome = await evaluate(model_config(server, tmp_path), evaluation, ["none", "none", str(useless)])
    assert [s.condition for s in outcome.summaries] == ["none", "none#2", "useless.txt"]
    mean_diffs = [c for c in outcome.comparisons if c.metric == "mean_at_k"]
    assert [c.candidate for c in mean_diffs] == ["none#2", "useless.txt"]
    for c in mean_diffs:
        assert c.ci_low <= 0 <= c.ci_high and not c.significant, c


async def test_leakage_guard_warns_with_ids_and_refuses_on_request(tmp_path):
    train_rows = make_problems(n_per_family=3, seed=1)
    train_rows[6]["problem"] += " Give the exact integer and check the partial results before answering."
    test_rows = make_problems(n_per_family=3, seed=2)
    test_rows[0] = {**train_rows[5], "id": "leaked-exact", "problem": "  " + train_rows[5]["problem"].upper()}
    test_rows[1] = {**train_rows[6], "id": "leaked-near", "problem": "Question: " + train_rows[6]["problem"]}
    train = DatasetConfig(path=str(write_jsonl(train_rows, tmp_path / "train.jsonl")))
    evaluation = EvalConfig(
        dataset=DatasetConfig(path=str(write_jsonl(test_rows, tmp_path / "test.jsonl"))), k=2, bootstrap_samples=200
    )
    with FakeOpenAIServer(ScriptedWorld(seed=1)) as server:
        cfg = model_config(server, tmp_path)
        refused = evaluation.model_copy(update={"refuse_on_leakage": True})
        with pytest.raises(LeakageError, match="leaked-exact~.*leaked-near~"):
            await evaluate(cfg, refused, ["none"], train_dataset=train)
        assert server.stats.by_role["policy"] == 0  # refused before sampling
        outcome = await evaluate(cfg, evaluation, ["none"], train_dataset=train)
    assert "2 of 12 evaluation problems" in outcome.leakage
    assert outcome.summaries[0].leaked_ids == ["leaked-exact", "leaked-near"]


def test_validation_curve_report_and_eval_from_the_command_line(tmp_path, capsys):
    train_path = write_jsonl(make_problems(n_per_family=4, seed=3), tmp_path / "train.jsonl")
    heldout_path = write_jsonl(
        [{**p, "id": "v-" + p["id"]} for p in make_problems(n_per_family=3, seed=9)], tmp_path / "heldout.jsonl"
    )
    db = tmp_path / "runs.duckdb"
    world = ScriptedWorld(seed=7)
    with FakeOpenAIServer(world) as server:
        config = tmp_path / "run.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "run_id": "curve",
                    "dataset": {"path": str(train_path), "seed": 1},
                    "policy": {
                        "model": "scripted",
                        "base_url": server.base_url,
                        "api_key_env": None,
                        "max_tokens": 256,
                    },
                    "grpo": {"group_size": 4, "epochs": 2, "batch_size": 16},
                    "learning": {"consolidate_chunk_size": 3, "summarize_chunk_size": 4},
                    "validation": {
                        "dataset": {"path": str(heldout_path)},
                        "k": 4,
                        "every_n_steps": 1,
                        "bootstrap_samples": 500,
                    },
                    "concurrency": 8,
                    "plots": True,
                }
            )
        )
        assert main(["train", "--config", str(config), "--db", str(db)]) == 0
        policy_calls = server.stats.by_role["policy"]
        assert main(["train", "--config", str(config), "--db", str(db)]) == 0  # resume: all read back
        assert server.stats.by_role["policy"] == policy_calls

        with Store(db, read_only=True) as store:
            curve = store.query(
                "SELECT step, mean_at_k, mean_ci_low, mean_ci_high, library_size, temperature "
                "FROM evaluations WHERE run_id = 'curve' ORDER BY step"
            )
            assert curve["step"].tolist() == [0, 1, 2]  # the baseline, then one row per validated step
            assert curve["library_size"].tolist()[0] == 0 and curve["library_size"].tolist()[-1] > 0
            assert curve["mean_at_k"].iloc[-1] > curve["mean_ci_high"].iloc[0]  # learned lessons generalize
            assert set(curve["temperature"]) == {0.3}
            calls = store.query("SELECT count(*) AS n FROM llm_calls WHERE run_id = 'curve' AND stage = 'validate'")
            libraries = store.query("SELECT DISTINCT library_hash FROM evaluations WHERE run_id = 'curve'")
            # 12 held-out problems: one request (n=4) each, once per library content (a step that left the
            # library as it was reads the earlier step's samples: the same draw keys)
            assert calls["n"][0] == 12 * len(libraries) and len(libraries) >= 2
        assert (tmp_path / "curve" / "plots" / "accuracy.png").read_bytes()[:4] == b"\x89PNG"
        capsys.readouterr()

        # evaluate the learned library against none: model settings come from the run's stored config; both
        # libraries were measured by the validation at the same temperature, k and seeds: nothing is drawn again
        policy_calls = server.stats.by_role["policy"]
        assert (
            main(
                [
                    "eval",
                    "--library",
                    "none",
                    "--compare",
                    "curve:latest",
                    "--dataset",
                    str(heldout_path),
                    "--k",
                    "4",
                    "--bootstrap",
                    "500",
                    "--db",
                    str(db),
                ]
            )
            == 0
        )
        out = capsys.readouterr().out
        assert server.stats.by_role["policy"] == policy_calls
        # evaluating on the training set itself is refused on request, naming the problems
        assert (
            main(
                [
                    "eval",
                    "--library",
                    "curve:1",
                    "--dataset",
                    str(train_path),
                    "--config",
                    str(config),
                    "--db",
                    str(db),
                    "--refuse-on-leakage",
                ]
            )
            == 2
        )
        assert "16 of 16 evaluation problems also appear in the training set" in capsys.readouterr().err
    assert "curve:2 - none: Mean@4 +" in out and "significant" in out and "[95% CI]" in out
    assert "leakage guard: none of 12 evaluation problems" in out  # checked against the run's training set

    assert main(["report", "curve", "--db", str(db)]) == 0
    html = (tmp_path / "curve" / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3
    with Store(db, read_only=True) as store:
        final = store.load_library("curve")
    assert all(e.text in html for e in final) and "held-out Mean@4" in html and "Evaluation eval-" in html
    assert main(["report", "curve", "--db", str(db), "--format", "md", "--out", str(tmp_path / "md")]) == 0
    markdown = (tmp_path / "md" / "report.md").read_text()
    assert "![accuracy](plots/accuracy.png)" in markdown and (tmp_path / "md" / "plots" / "tokens_cost.png").exists()
    assert "+ [E0]" in markdown


async def test_a_failed_evaluation_keeps_the_calls_it_made(tmp_path):
    from clgrpo.testing.fake_openai import Fault

    dataset = write_jsonl(make_problems(n_per_family=1, seed=21), tmp_path / "test.jsonl")
    evaluation = EvalConfig(dataset=DatasetConfig(path=str(dataset)), k=2, bootstrap_samples=200)
    with FakeOpenAIServer(ScriptedWorld(seed=3)) as server:
        cfg = model_config(server, tmp_path).model_copy(
            update={"policy": model_config(server, tmp_path).policy.model_copy(update={"max_retries": 1})}
        )
        server.inject(Fault(kind="status", status=502, rate=1.0))  # the endpoint is down for the whole evaluation
        with pytest.raises(RuntimeError, match="policy calls failed"):
            await evaluate(cfg, evaluation, ["none"], eval_id="down")
        requests = server.stats.chat_requests
    with Store(cfg.db_path, read_only=True) as store:
        calls = store.records("llm_calls", "down")
        assert not store.stage_done("down", 0, "evaluate")
    assert requests > 0 and len(calls) == requests and all("HTTP 502" in c.error for c in calls)
