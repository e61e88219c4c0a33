"""The offline demo's wiring (real Prefect flow, transformers backend) on the tiny random model, and one slow
test on the real embedded model."""

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from clgrpo.demo import DemoOptions, demo_config, run_demo, summary
from clgrpo.llm import LLMClient
from clgrpo.models import ModelError, fetch_embedded
from clgrpo.store import Store
from domains.learner import OPERATIONS_SCHEMA, LearnerPrompts
from domains.math.prompts import rollout_messages
from schemas.records import Problem
from tests.tiny_model import build_tiny_model


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
def test_demo_runs_the_real_flow_on_a_local_model(tmp_path, capsys):
    model = build_tiny_model(tmp_path / "tiny")
    opts = DemoOptions(problems=3, group_size=2, steps=2, out=tmp_path / "demo", run_id="demo-test",
                       rollout_tokens=8, learner_tokens=8, model_path=str(model), model_name="tiny", verbose=True)
    result = run_demo(opts)
    assert [s.step for s in result.steps] == [1, 2]
    assert result.engine["tokens_out"] > 0 and result.seconds["flow"] > 0
    with Store(result.db_path, read_only=True) as store:
        calls = store.query("SELECT stage, model, tokens_out FROM llm_calls WHERE run_id='demo-test'")
        assert set(calls.stage) >= {"rollout"} and set(calls.model) == {"tiny"}
        rollouts = store.query("SELECT count(*) AS n FROM rollouts WHERE run_id='demo-test'")
        assert rollouts["n"][0] == 3 * 2 * 2
        assert store.run_config("demo-test").policy.backend == "transformers"
    out = capsys.readouterr().out
    assert "step 1 rollout: stored 6 rollouts, 3 llm calls" in out  # a line per stage, counts named
    assert "step 2 (epoch 2): accuracy" in out  # and per step
    assert "sequences in one batch" in out  # one line per batched generate call
    text = summary(result)
    assert "DuckDB:" in text and "library files:" in text and "tokens/s" in text


def test_demo_config_is_one_run_config_with_local_models(tmp_path):
    cfg = demo_config(DemoOptions(out=tmp_path), tmp_path / "d.jsonl", "demo-x")
    assert cfg.policy.backend == cfg.learner.backend == "transformers"
    assert cfg.policy.model_path == "embedded" and cfg.grpo.epochs == 2 and cfg.grpo.batch_size == 8
    assert cfg.policy.max_tokens < cfg.learner.max_tokens and cfg.concurrency >= 8 * 4


@pytest.fixture(scope="module")
def embedded_model():
    try:
        return fetch_embedded(log=lambda _m: None).hf_dir
    except ModelError as exc:
        pytest.skip(f"the embedded model is not cached and cannot be fetched here: {exc}")


@pytest.mark.slow
async def test_real_embedded_model_one_rollout_and_one_learner_call(embedded_model):
    from schemas.config import ModelConfig

    cfg = ModelConfig(backend="transformers", model="SmolLM2-135M-Instruct", model_path="embedded",
                      max_tokens=96, temperature=0.7, seed=0, timeout_s=600)
    client = LLMClient(cfg)
    problem = Problem(problem_id="p1", problem="What is 7 + 5?", answer="12", source="test")
    sampled = await client.sample(rollout_messages(problem, ""), 2, stage="rollout")
    assert len(sampled.texts) == 2 and all(t.strip() for t in sampled.texts)
    assert len(sampled.calls) == 1 and sampled.calls[0].tokens_out > 0

    prompts = LearnerPrompts("arithmetic")
    messages = prompts.consolidate(json.dumps([{"op": "add", "text": "Add the two numbers carefully."}]), "",
                                   min_words=5, max_words=24)
    reply = await client.complete_operations(messages, stage="consolidate", json_schema=OPERATIONS_SCHEMA,
                                             repair=LearnerPrompts().repair)
    # constrained decoding: the reply is valid operations JSON unless it ran out of tokens mid-string
    assert reply.parse_error is None or "unparseable" in reply.parse_error
    assert all(c.ok and c.tokens_out > 0 for c in reply.calls)
    await client.aclose()


@pytest.mark.slow
@pytest.mark.demo
@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness", "embedded_model")
def test_default_demo_on_the_embedded_model_applies_a_lesson_of_its_own(tmp_path):
    """The acceptance of the demo, end to end (about 4 minutes on 2 cores): the default ``clgrpo demo`` on the
    real SmolLM2-135M ends with at least one applied lesson of 6+ words that passed every library rule and the
    lesson screen (not copied from the prompt or a problem, no answer), and its summary lists every rejected
    operation with its reason. Sampling is unseeded, as in the demo."""
    result = run_demo(DemoOptions(out=tmp_path / "demo"), out=lambda line: None)
    applied = [r for _, r in result.operations if r.status.value == "applied"]
    rejected = [r for _, r in result.operations if r.status.value == "rejected"]
    assert result.library and applied, summary(result)
    assert all(len(text.split()) >= 6 for _, text in result.library)
    text = summary(result)
    assert all(r.reason in text for r in rejected)
    assert "clgrpo report" in text
