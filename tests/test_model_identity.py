"""A model's identity (issue 59): what its endpoint states of the weights, read once at the preflight, and the
``revision`` a user sets. It decides what stored samples and evaluations are reused and whether a run resumes.

Unit tests: which fields of a ``GET /models`` entry count (llama-server's ``meta``, vLLM's ``root``; never the
request's time), draw keys and evaluation fingerprints with and without an identity, a resume's check, the local
weights' hash, the provider's ``system_fingerprint`` per call. The CLI tests from outside are
``tests/test_model_identity_cli.py``.
"""

from __future__ import annotations

import asyncio

import pytest

from application.commands.runs import fingerprint_line
from clgrpo.experience.library import ExperienceLibrary
from clgrpo.models.weights import ModelLocation, weights_digest
from clgrpo.storage.store import ModelChangedError, Store, identity_change
from clgrpo.testing.fake_openai import FakeOpenAIServer
from clgrpo.testing.scripted_llm import ScriptedWorld
from domains import domain_for
from flows.evaluate import Condition, drawn_line, eval_fingerprint
from schemas.config import DatasetConfig, EvalConfig, ModelConfig, ModelIdentity, RunConfig, ServedModel
from schemas.records import LLMCall, Problem, Sample
from tasks.measure import Sampling, draw_keys, sample_seeds
from tasks.preflight import check_policy, check_run, served_model

PROBLEMS = [Problem(problem_id=f"p{i}", problem=f"What is {i} + {i}?", answer=str(2 * i)) for i in range(3)]
LLAMA_A = {  # what llama-server states of the weights it serves (GET /v1/models: the entry's meta)
    "meta": {"vocab_type": 2, "n_vocab": 151936, "n_ctx_train": 32768, "n_embd": 896, "n_params": 494032768,
             "size": 397808896}
}  # fmt: skip
LLAMA_B = {"meta": {**LLAMA_A["meta"], "size": 675710816}}  # the same model quantized otherwise


def config(served: ServedModel | None = None, port: int = 9, **policy) -> RunConfig:
    return RunConfig(
        dataset=DatasetConfig(path="unused.jsonl"),
        policy=ModelConfig(
            model="local", base_url=f"http://127.0.0.1:{port}/v1", api_key_env=None, served=served, **policy
        ),
    )


def stated(fields: dict) -> ServedModel:
    return ServedModel(source="GET /models", fields=fields)


def keys(cfg: RunConfig) -> set[str]:
    sampling = Sampling.of(cfg, 0.3)
    return set(
        draw_keys(PROBLEMS, ExperienceLibrary(), 2, sample_seeds(PROBLEMS, 0), sampling, domain_for(cfg)).values()
    )


# --- what counts ------------------------------------------------------------------------------------------------
def test_the_weights_fields_of_a_models_entry_count_and_nothing_that_changes_per_request():
    llama = {"id": "local", "object": "model", "created": 1764500000, "owned_by": "llamacpp", **LLAMA_A}
    assert served_model(llama).fields == LLAMA_A
    assert served_model({**llama, "created": 1764500999}) == served_model(llama)  # the time of the request
    # newer llama-servers state the context a slot was started with in meta too: a setting, not the weights
    started = {**llama, "meta": {**LLAMA_A["meta"], "n_ctx": 8192}, "aliases": ["local"], "tags": []}
    assert served_model(started).fields == LLAMA_A
    assert served_model({**started, "meta": {**started["meta"], "n_ctx": 4096}}) == served_model(started)
    router = {"id": "local", "object": "model", "owned_by": "llamacpp", "created": 1, "path": "/m/q4.gguf",
              "status": {"value": "loaded"}, "in_cache": True}  # fmt: skip
    assert served_model(router).fields == {"path": "/m/q4.gguf"}
    vllm = {
        "id": "qwen",
        "object": "model",
        "created": 1764500000,
        "owned_by": "vllm",
        "root": "/models/qwen2.5-0.5b",
        "parent": None,
        "max_model_len": 32768,
        "permission": [{"id": "modelperm-1f2e", "created": 1764500000}],
    }
    assert served_model(vllm).fields == {"root": "/models/qwen2.5-0.5b"}
    openai = {"id": "gpt-4o-mini", "object": "model", "created": 1721172741, "owned_by": "system"}
    assert served_model(openai).fields == {}  # nothing of the weights: the name (and a revision) is all there is
    assert served_model(None).fields == {}


def test_the_preflight_returns_the_config_with_what_the_endpoint_states(tmp_path):
    with FakeOpenAIServer(ScriptedWorld(seed=1), models=("local",), model_info=LLAMA_A) as server:
        checked = asyncio.run(check_policy(config(port=server.port)))
    identity = checked.policy.identity()
    assert identity.checked and identity.fields == LLAMA_A
    assert "meta.n_params=494032768" in identity.label and "meta.size=397808896" in identity.label
    with FakeOpenAIServer(ScriptedWorld(seed=1), models=("local",)) as server:
        nothing = asyncio.run(check_policy(config(port=server.port))).policy.identity()
    assert nothing.checked and nothing.key is None
    assert nothing.label == "'local' (the endpoint states nothing more of it)"


def test_check_run_states_the_learners_identity_too(tmp_path):
    dataset = tmp_path / "train.jsonl"
    dataset.write_text('{"id": "a", "problem": "What is 1 + 1?", "answer": "2"}\n')
    with (
        FakeOpenAIServer(ScriptedWorld(seed=1), models=("local",), model_info=LLAMA_A) as policy,
        FakeOpenAIServer(ScriptedWorld(seed=1), models=("teacher",), model_info={"root": "/m/t"}) as learner,
    ):
        cfg = config(port=policy.port).model_copy(
            update={
                "dataset": DatasetConfig(path=str(dataset)),
                "db_path": str(tmp_path / "db.duckdb"),
                "learner": ModelConfig(model="teacher", base_url=learner.base_url, api_key_env=None),
            }
        )
        checked = asyncio.run(check_run(cfg))
    assert checked.policy.identity().fields == LLAMA_A
    assert checked.learner is not None and checked.learner.identity().fields == {"root": "/m/t"}
    assert checked.fingerprint() == cfg.fingerprint()  # what the endpoint states is no setting of the run


# --- what it decides --------------------------------------------------------------------------------------------
def test_a_draw_key_follows_the_models_identity_not_its_address():
    unknown = keys(config())  # not asked: as samples were keyed before identities existed
    assert keys(config(stated({}))) == unknown  # an endpoint that states nothing: its name is all that is known
    a = keys(config(stated(LLAMA_A)))
    assert not a & unknown  # samples stored before identities existed are not read where the model is known
    assert keys(config(stated(LLAMA_A), port=10)) == a  # the same model on another port draws the same samples
    assert not keys(config(stated(LLAMA_B))) & a  # other weights behind the same name: drawn anew
    assert not keys(config(stated({}), revision="q4_k_m-2026-11")) & unknown  # the user's revision counts
    assert keys(config(stated({}), revision="r2")) != keys(config(stated({}), revision="r3"))
    assert Sampling.of(config(stated(LLAMA_A)), 0.3).model == config(stated(LLAMA_A)).policy.identity().label
    assert Sampling.of(config(), 0.3).model is None  # not asked: no identity to record


def test_an_evaluations_fingerprint_follows_the_models_identity():
    evaluation = EvalConfig(dataset=DatasetConfig(path="e.jsonl"))
    conditions = [Condition("none", "none", ExperienceLibrary())]

    def fingerprint(cfg: RunConfig) -> str:
        return eval_fingerprint(cfg, evaluation, conditions, PROBLEMS)

    assert fingerprint(config(stated({}))) == fingerprint(config())  # known by name only: stored ones read back
    assert fingerprint(config(stated(LLAMA_A))) != fingerprint(config())
    assert fingerprint(config(stated(LLAMA_A))) == fingerprint(config(stated(LLAMA_A), port=10))
    assert fingerprint(config(stated(LLAMA_A))) != fingerprint(config(stated(LLAMA_B)))


def test_the_run_fingerprint_ignores_the_identity():
    assert config(stated(LLAMA_A), revision="r2").fingerprint() == config().fingerprint()


# --- a resumed run --------------------------------------------------------------------------------------------
def test_a_resume_against_another_model_is_refused_in_one_line_naming_both():
    a = config(stated(LLAMA_A)).policy.identity()
    b = config(stated(LLAMA_B)).policy.identity()
    assert identity_change("r", a, a) is None
    assert identity_change("r", a, config().policy.identity()) is None  # not asked: nothing to compare
    with pytest.raises(ModelChangedError) as refused:
        identity_change("r", a, b)
    line = str(refused.value)
    assert "\n" not in line and a.label in line and b.label in line and "--accept-model-change" in line
    accepted = identity_change("r", a, b, accept_change=True)
    assert accepted is not None and a.label in accepted and b.label in accepted and "as asked" in accepted
    bound = identity_change("r", None, b)  # a run stored before identities existed: bound from now on
    assert bound is not None and "before model identities were recorded" in bound


def test_the_store_binds_a_run_to_its_model(tmp_path):
    a = config(stated(LLAMA_A)).model_copy(update={"run_id": "r", "db_path": str(tmp_path / "x.duckdb")})
    b = a.model_copy(update={"policy": a.policy.model_copy(update={"served": stated(LLAMA_B)})})
    with Store(tmp_path / "x.duckdb") as store:
        assert store.register_run(a)
        assert store.run_identity("r") == a.policy.identity().__class__.from_json(a.policy.identity().to_json())
        assert not store.register_run(b)  # the same config: another model is the identity's business
        with pytest.raises(ModelChangedError):
            store.bind_identity("r", b.policy.identity())
        assert store.bind_identity("r", b.policy.identity(), accept_change=True) is not None
        assert store.run_identity("r") is not None and store.run_identity("r").key == b.policy.identity().key
        assert store.bind_identity("r", b.policy.identity()) is None


def test_an_identity_survives_its_json():
    identity = ModelIdentity("local", LLAMA_A, "r2")
    assert ModelIdentity.from_json(identity.to_json()) == identity


# --- local weights ------------------------------------------------------------------------------------------
def test_local_weights_are_known_by_their_hash_read_once(tmp_path, monkeypatch):
    monkeypatch.setenv("CLGRPO_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 1000)
    first = weights_digest(ModelLocation(tmp_path, "model.gguf"))
    assert (tmp_path / "cache" / "weights-sha256.json").is_file()
    assert weights_digest(ModelLocation(tmp_path, "model.gguf")) == first
    gguf.write_bytes(b"GGUF" + b"\1" * 1000)  # re-quantized under the same file name
    assert weights_digest(ModelLocation(tmp_path, "model.gguf")) != first
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    digest = weights_digest(ModelLocation(folder))
    (folder / "model.safetensors").write_bytes(b"y" * 10)
    assert weights_digest(ModelLocation(folder)) != digest


# --- what is shown ------------------------------------------------------------------------------------------
def test_a_read_back_says_when_its_samples_were_drawn_and_by_which_model():
    from datetime import datetime, timezone

    def sample(minute: int | None, model: str | None) -> Sample:
        at = None if minute is None else datetime(2026, 11, 30, 14, minute, tzinfo=timezone.utc)
        return Sample(problem_id="p", sample_idx=0, seed=1, reward=1.0, model_identity=model, drawn_at=at)

    line = drawn_line([sample(2, "'local' [ab]"), sample(5, "'local' [ab]"), sample(None, None)])
    assert line == "2 drawn 2026-11-30 14:02-14:05 UTC by 'local' [ab]; 1 drawn before model identities were recorded"


def test_runs_show_says_when_the_providers_system_fingerprint_changed(tmp_path):
    def call(step: int, fingerprint: str | None, second: int) -> LLMCall:
        from datetime import datetime, timezone

        started = datetime(2026, 11, 30, 14, 0, second, tzinfo=timezone.utc)
        return LLMCall(stage="rollout", role="policy", model="m", started_at=started, system_fingerprint=fingerprint)

    cfg = config().model_copy(update={"run_id": "r", "db_path": str(tmp_path / "x.duckdb")})
    with Store(tmp_path / "x.duckdb") as store:
        store.register_run(cfg)
        for step, calls in ((1, [call(1, "fp_a", 1), call(1, "fp_a", 2)]), (2, [call(2, "fp_b", 3), call(2, None, 4)])):
            store.write_stage("r", step, "rollout", {"llm_calls": calls})
        stretches = store.system_fingerprints("r")
    assert stretches == [("fp_a", 1, 1, 2), ("fp_b", 2, 2, 1)]
    line = fingerprint_line(stretches)
    assert line.startswith("system_fingerprint changed during the run (1 time): fp_a (step 1, 2 calls) -> fp_b")
    assert fingerprint_line([("fp_a", 1, 3, 9)]).startswith("system_fingerprint fp_a on every")
    assert fingerprint_line([]) == ""


def test_a_providers_system_fingerprint_is_stored_with_each_call():
    from clgrpo.llm.backends import generation

    reply = {"choices": [{"message": {"content": "4"}, "finish_reason": "stop"}], "system_fingerprint": "fp_44709d6fcb"}
    assert generation(reply, "x").system_fingerprint == "fp_44709d6fcb"
    assert generation({**reply, "system_fingerprint": None}, "x").system_fingerprint is None
