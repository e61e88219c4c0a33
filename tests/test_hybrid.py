"""Hybrid learning: the numeric GRPO step (LoRA, peft) on the tiny random model, fed from stored trajectories."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.llm.adapters import AdapterError, adapter_base, check_adapter, model_identity, resolve_adapter
from clgrpo.llm.client import shared_client
from clgrpo.models import hybrid
from clgrpo.models.weights import resolve_model_path
from domains import get_domain
from schemas.config import DatasetConfig, GRPOConfig, HybridConfig, ModelConfig, RunConfig
from schemas.records import GroupAdvantage, NumericItem, Problem
from tasks.numeric_update import numeric_inputs, train_step
from tasks.rollout import rollout
from tests.tiny_model import build_tiny_model

PROBLEMS = [Problem(problem_id=f"p{i}", problem=f"What is {i} + 3?", answer=str(i + 3)) for i in range(2)]
SETTINGS = HybridConfig(enabled=True, rank=4, alpha=8, lr=2e-2, epochs=4, batch_rows=4, seed=0)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def config_for(model: Path, tmp_path: Path, **hybrid_settings) -> RunConfig:
    policy = ModelConfig(
        backend="transformers", model="tiny", model_path=str(model), device="cpu", cpu_threads=1, max_tokens=6
    )
    return RunConfig(
        run_id="hy",
        db_path=str(tmp_path / "runs.duckdb"),
        dataset=DatasetConfig(path="unused.jsonl"),
        policy=policy,
        grpo=GRPOConfig(group_size=4),
        hybrid=SETTINGS.model_copy(update=hybrid_settings),
    )


@pytest.fixture(scope="module")
def sampled(tiny_model, tmp_path_factory):
    """Real rollouts of the tiny model (through the transformers backend), as the rollout stage stores them."""
    cfg = config_for(tiny_model, tmp_path_factory.mktemp("sampled"))
    library = ExperienceLibrary()
    batch = asyncio.run(
        rollout(
            PROBLEMS,
            library,
            get_domain("math"),
            shared_client(cfg),
            group_size=4,
            temperature=1.0,
            seeds={p.problem_id: 7 for p in PROBLEMS},
        )
    )
    assert all(r.error is None and r.final_text for r in batch.rollouts)
    return batch.rollouts, library.to_version()


def groups(signs: list[float]) -> list[GroupAdvantage]:
    """The stored group advantages: samples 0, 1 of each group rewarded (``signs`` per sample)."""
    rewards = [None if s is None else 1.0 if s > 0 else 0.0 for s in signs]
    return [
        GroupAdvantage(
            problem_id=p.problem_id,
            rewards=rewards,
            mean_reward=0.5,
            std_reward=0.5,
            advantages=signs,
            selected=True,
            reason="variance",
        )
        for p in PROBLEMS
    ]


def mean_logprobs(model, items: list[NumericItem], tokenizer) -> list[float]:
    examples = hybrid.examples_from(items, tokenizer)
    return [float(lp.mean()) for lp in hybrid._logprobs(model, examples, 8, tokenizer.pad_token_id)]


def test_the_loss_decreases_on_a_fixed_batch(tiny_model):
    location = resolve_model_path(str(tiny_model))
    model, tokenizer = hybrid.load_trainable(location, "cpu", SETTINGS, None)
    items = [
        NumericItem(
            problem_id="p",
            sample_idx=i,
            messages=[{"role": "user", "content": "What is 2 + 3?"}],
            completion=text,
            advantage=a,
        )
        for i, (text, a) in enumerate(
            [("The answer is 5.", 1.0), ("lesson lesson", -1.0), ("boxed 5", 1.0), ("system user", -1.0)]
        )
    ]
    outcome = hybrid.train_adapter(model, hybrid.examples_from(items, tokenizer), SETTINGS, tokenizer.pad_token_id)
    assert outcome.rows_used == 4 and outcome.device == "cpu"
    assert outcome.loss_before == pytest.approx(0.0, abs=1e-6)  # ratio 1: minus the mean advantage (here 0)
    assert outcome.loss_after < outcome.loss_before - 0.05
    assert outcome.logprob_change_pos > 0 > outcome.logprob_change_neg


def test_a_fresh_adapter_is_the_same_every_time(tiny_model):
    """Its random A matrices are seeded (hybrid.seed): a rerun of a numeric step learns the same adapter."""
    import torch

    location = resolve_model_path(str(tiny_model))
    weights = []
    for draw in range(2):
        torch.manual_seed(draw)  # whatever the process drew before
        model, _ = hybrid.load_trainable(location, "cpu", SETTINGS, None)
        weights.append({k: v.clone() for k, v in model.state_dict().items() if "lora_A" in k})
    assert weights[0] and weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_advantages_come_from_the_stored_groups_and_flipping_them_flips_the_change(tiny_model, sampled, tmp_path):
    rollouts, version = sampled
    cfg = config_for(tiny_model, tmp_path)
    signs = [1.0, 1.0, -1.0, -1.0]
    changes = []
    for _flip, stored in ((1, signs), (-1, [-s for s in signs])):
        inputs = numeric_inputs(cfg, PROBLEMS, rollouts, groups(stored), version)
        assert [i.advantage for i in inputs.items] == stored * 2 and inputs.skipped == 0
        assert [i.completion for i in inputs.items] == [r.final_text for r in rollouts]
        location = resolve_model_path(str(tiny_model))
        model, tokenizer = hybrid.load_trainable(location, "cpu", cfg.hybrid, None)
        before = mean_logprobs(model, inputs.items, tokenizer)
        hybrid.train_adapter(model, hybrid.examples_from(inputs.items, tokenizer), cfg.hybrid, tokenizer.pad_token_id)
        after = mean_logprobs(model, inputs.items, tokenizer)
        changes.append([a - b for a, b in zip(after, before)])
    first, flipped = changes
    # the completions rewarded in the stored groups gained on average, the others lost; flipped: the reverse
    up = [c for c, s in zip(first, signs * 2) if s > 0]
    down = [c for c, s in zip(first, signs * 2) if s < 0]
    assert sum(up) / len(up) > 0 > sum(down) / len(down)
    up_flipped = [c for c, s in zip(flipped, signs * 2) if s > 0]
    down_flipped = [c for c, s in zip(flipped, signs * 2) if s < 0]
    assert sum(up_flipped) / len(up_flipped) < 0 < sum(down_flipped) / len(down_flipped)


def test_zero_advantage_groups_and_changed_prompts_are_skipped(tiny_model, sampled, tmp_path):
    rollouts, version = sampled
    cfg = config_for(tiny_model, tmp_path)
    stored = groups([1.0, -1.0, 0.0, None])
    stored[1] = stored[1].model_copy(update={"advantages": [0.0] * 4})  # p1: no variance
    inputs = numeric_inputs(cfg, PROBLEMS, rollouts, stored, version)
    assert [(i.problem_id, i.sample_idx, i.advantage) for i in inputs.items] == [("p0", 0, 1.0), ("p0", 1, -1.0)]
    assert inputs.skipped == 6
    # not the library the rollouts were sampled with: their prompts no longer match
    other = ExperienceLibrary.from_mapping({"E1": "Check units before the final answer."})
    assert numeric_inputs(cfg, PROBLEMS, rollouts, groups([1.0, 1.0, -1.0, -1.0]), other.to_version()).items == []


def test_a_saved_adapter_continues_and_is_refused_on_another_base(tiny_model, sampled, tmp_path):
    rollouts, version = sampled
    cfg = config_for(tiny_model, tmp_path)
    items = numeric_inputs(cfg, PROBLEMS, rollouts, groups([1.0, 1.0, -1.0, -1.0]), version).items
    first = train_step(cfg, 1, items, 0, None, 0, tmp_path / "adapter_step1")
    assert (tmp_path / "adapter_step1" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "adapter_step1.partial").exists()
    assert adapter_base(first.path) == model_identity(resolve_model_path(str(tiny_model))) == first.base_model
    location = resolve_model_path(str(tiny_model))
    fresh, tokenizer = hybrid.load_trainable(location, "cpu", cfg.hybrid, None)
    continued, _ = hybrid.load_trainable(location, "cpu", cfg.hybrid, first.path)
    base_lp, first_lp = mean_logprobs(fresh, items, tokenizer), mean_logprobs(continued, items, tokenizer)
    gained = [a - b for a, b, i in zip(first_lp, base_lp, items) if i.advantage > 0]
    assert sum(gained) / len(gained) == pytest.approx(first.logprob_change_pos, abs=1e-4)  # the saved weights
    second = train_step(cfg, 2, items, 0, first.path, 0, tmp_path / "adapter_step2")
    assert second.parent_path == first.path and second.rows_used == len(items) == 8
    check_adapter(first.path, cfg.policy)
    other = build_tiny_model(tmp_path / "other-model")
    (other / "config.json").write_text(
        (other / "config.json").read_text().replace('"hidden_size": 32', '"hidden_size": 64')
    )
    with pytest.raises(
        AdapterError,
        match=r"trained on base model tiny-model\d*@\w+, but the policy is "
        r"other-model@\w+",
    ):
        check_adapter(first.path, cfg.policy.model_copy(update={"model_path": str(other)}))
    with pytest.raises(AdapterError, match="needs the run's database"):
        resolve_adapter("hy:1", None)


def test_hybrid_settings_count_in_the_fingerprint_only_when_enabled(tmp_path):
    cfg = RunConfig(dataset=DatasetConfig(path="t.jsonl"))
    off = cfg.model_copy(update={"hybrid": HybridConfig(rank=32)})  # disabled: its settings shape nothing
    assert off.fingerprint() == cfg.fingerprint()
    on = cfg.model_copy(update={"hybrid": HybridConfig(enabled=True)})
    assert on.fingerprint() != cfg.fingerprint()
    pooled = cfg.model_copy(update={"hybrid": HybridConfig(enabled=True, placement="pool")})
    assert pooled.fingerprint() == on.fingerprint()  # where it runs never changes results
    recomputed = cfg.model_copy(update={"hybrid": HybridConfig(enabled=True, gradient_checkpointing=False)})
    assert recomputed.fingerprint() == on.fingerprint()  # nor how the gradients are computed
    adapted = cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"adapter": "runs/x/adapter_step1"})})
    assert adapted.fingerprint() != cfg.fingerprint()


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_a_stored_step_is_read_back_and_a_killed_one_leaves_no_row(tiny_model, sampled, tmp_path, monkeypatch):
    from prefect import flow

    import tasks.numeric_update as stage
    from clgrpo.llm.adapters import adapter_dir
    from clgrpo.storage.store import Store
    from flows.train import Trainer
    from tasks.checkpoint import export_dir

    rollouts, version = sampled
    cfg = config_for(tiny_model, tmp_path)
    stored = groups([1.0, 1.0, -1.0, -1.0])

    @flow
    async def numeric_step(step: int):
        with Store(cfg.db_path) as store:
            return await Trainer(cfg, store).numeric_update(step, PROBLEMS, rollouts, stored, version)

    def killed(model, folder):
        folder.mkdir(parents=True)
        (folder / "adapter_model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt("killed while saving")

    with monkeypatch.context() as patch:
        patch.setattr(hybrid, "save_adapter", killed)
        with pytest.raises(BaseException, match="killed while saving"):
            await numeric_step(1)
    with Store(cfg.db_path, read_only=True) as store:
        assert not store.stage_done("hy", 1, "numeric_update") and store.records("adapters", "hy") == []
    assert not adapter_dir(export_dir(cfg), 1).exists()

    first = await numeric_step(1)
    assert first.rows_used == 8 and Path(first.path) == adapter_dir(export_dir(cfg), 1)
    assert (Path(first.path) / "adapter_model.safetensors").stat().st_size > 100
    with monkeypatch.context() as patch:
        patch.setattr(stage, "train_step", lambda *a, **k: pytest.fail("a stored step was trained again"))
        again = await numeric_step(1)
    assert again == first
    second = await numeric_step(2)
    assert second.parent_path == first.path  # each step continues from the previous step's adapter
    with Store(cfg.db_path, read_only=True) as store:
        rows = store.query("SELECT step, rows_used, library_version FROM adapters WHERE run_id = 'hy' ORDER BY step")
    assert rows["step"].tolist() == [1, 2] and rows["rows_used"].tolist() == [8, 8]


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_eval_conditions_adapter_and_both_use_the_stored_adapter(tiny_model, sampled, tmp_path):
    import json

    from clgrpo.llm.adapters import adapter_dir
    from clgrpo.storage.store import Store
    from flows.evaluate import evaluate
    from schemas.config import EvalConfig
    from tasks.checkpoint import export_dir

    rollouts, version = sampled
    cfg = config_for(tiny_model, tmp_path, lr=5e-2)
    items = numeric_inputs(cfg, PROBLEMS, rollouts, groups([1.0, 1.0, -1.0, -1.0]), version).items
    record = train_step(cfg, 1, items, 0, None, 0, adapter_dir(export_dir(cfg), 1))
    library = ExperienceLibrary.from_mapping({"E1": "Add the two numbers, then check the sum."}, step=1)
    library = ExperienceLibrary.from_version(library.to_version().model_copy(update={"version": 1}))
    with Store(cfg.db_path) as store:
        store.register_run(cfg)
        store.save_library("hy", ExperienceLibrary())
        store.save_library("hy", library)
        store.write_stage("hy", 1, "numeric_update", {"adapters": [record]})
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text(
        "".join(
            json.dumps({"id": f"h{i}", "problem": f"What is {i} + 4?", "answer": str(i + 4)}) + "\n" for i in range(3)
        )
    )
    evaluation = EvalConfig(dataset=DatasetConfig(path=str(heldout)), k=2, temperature=1.0, bootstrap_samples=100)
    outcome = await evaluate(cfg, evaluation, ["none", "adapter:hy:1", "both:hy:latest", "hy:1"], eval_id="ev")
    assert [s.condition for s in outcome.summaries] == ["none", "adapter:hy:1", "both:hy:1", "hy:1"]
    with Store(cfg.db_path, read_only=True) as store:
        texts = {}
        for row in store.records("eval_results", "ev", 0, "evaluate"):
            texts.setdefault(row.condition, []).append(row.final_text)
    # the same seeds: the base model repeats itself without a library; the adapter changes what it samples
    assert texts["none"] != texts["adapter:hy:1"]
    assert texts["both:hy:1"] != texts["hy:1"]
    with pytest.raises(AdapterError, match="has no adapter of run 'hy' at step 2"):
        await evaluate(cfg, evaluation, ["none", "adapter:hy:2"], eval_id="ev2")


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_a_training_run_with_hybrid_learning_trains_one_adapter_per_step(tiny_model, tmp_path):
    from clgrpo.llm.local import loaded_engines
    from clgrpo.storage.store import Store
    from clgrpo.testing.fake_openai import FakeOpenAIServer
    from clgrpo.testing.scripted_llm import ScriptedWorld, make_problems, write_jsonl
    from flows.train import train
    from tests.stored_steps import seed_first_step

    dataset = write_jsonl(make_problems(n_per_family=1, seed=2), tmp_path / "train.jsonl")
    with FakeOpenAIServer(ScriptedWorld(seed=1)) as server:
        learner = ModelConfig(
            model="scripted",
            base_url=server.base_url,
            api_key_env=None,
            max_tokens=256,
            retry_base_delay_s=0.01,
            timeout_s=10,
        )
        cfg = config_for(tiny_model, tmp_path).model_copy(
            update={
                "dataset": DatasetConfig(path=str(dataset), seed=1),
                "learner": learner,
                "grpo": GRPOConfig(group_size=4, batch_size=2, max_steps=2, rollout_chunk_size=2),
            }
        )
        seeded = seed_first_step(cfg)  # step 1: two right and two wrong answers per group
        result = await train(cfg)
    assert [s.step for s in result.steps] == [1, 2]
    with Store(cfg.db_path, read_only=True) as store:
        first, second = store.records("adapters", "hy")
        stages = store.query("SELECT stage FROM stage_runs WHERE run_id = 'hy' AND step = 1")["stage"].tolist()
        step2 = store.records("rollouts", "hy", 2)
    assert "numeric_update" in stages
    assert first.rows_used == len(seeded) == 8 and first.library_version == 0
    assert first.logprob_change_pos > 0 > first.logprob_change_neg and first.loss_after < first.loss_before
    # step 2: the tiny model's own answers, all wrong (no variance: nothing to learn), the adapter carried on
    assert all(r.error is None for r in step2) and second.rows_used == 0
    assert second.parent_path == first.path and Path(second.path).name == "adapter_step2"
    assert (Path(second.path) / "adapter_model.safetensors").is_file()
    # on-policy: step 2 sampled with step 1's adapter (merged into a second loaded copy of the tiny model)
    adapted = [e for e in loaded_engines() if first.path in e.name]
    assert len(adapted) == 1 and adapted[0].stats.rows == len(step2)


def test_released_engines_free_their_models_and_reload_on_demand(tiny_model):
    from clgrpo.llm.local import loaded_engines, release_engines
    from clgrpo.llm.transformers_backend import TransformersBackend

    cfg = ModelConfig(backend="transformers", model="tiny", model_path=str(tiny_model), device="cpu", cpu_threads=1)
    engine = TransformersBackend(cfg).engine
    engine.load()
    assert release_engines(lambda key: key[-1] is None and str(tiny_model) in str(key)) == 1
    assert engine not in loaded_engines() and engine._model is None
    assert engine.load() is not None  # a client still holding it loads it again


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
async def test_a_finished_pool_handoff_is_ingested_without_starting_a_child(tiny_model, sampled, tmp_path, monkeypatch):
    """A parent that crashed after its numeric-update-gpu child finished: the retry copies the handed-off adapter
    into the export dir and starts nothing."""
    import json

    from prefect import flow

    import flows.numeric_gpu as pool
    from clgrpo.llm.adapters import adapter_dir
    from tasks.checkpoint import export_dir

    rollouts, version = sampled
    cfg = config_for(tiny_model, tmp_path, placement="pool", handoff_storage=str(tmp_path / "handoff"))
    items = numeric_inputs(cfg, PROBLEMS, rollouts, groups([1.0, 1.0, -1.0, -1.0]), version).items
    parent = train_step(cfg, 1, items, 0, None, 0, tmp_path / "elsewhere" / "adapter_step1")
    key = pool.inputs_hash(
        {
            "fingerprint": cfg.fingerprint(),
            "run_id": cfg.run_id,
            "step": 2,
            "items": items,
            "parent": parent.path,
            "library_version": 0,
            "db_id": "db",
        }
    )
    url = pool.handoff_folder(cfg, 2, key)
    worker_side = train_step(cfg, 2, items, 0, parent.path, 0, tmp_path / "worker" / "adapter_step2")
    pool.upload_folder(Path(worker_side.path), f"{url}/adapter")
    Path(url, pool.RECORD).write_text(
        json.dumps(
            {"record": worker_side.model_dump(mode="json"), "meta": {"host": "gpu-1", "cuda_visible_devices": "0"}}
        )
    )

    async def no_child(*args, **kwargs):
        raise AssertionError("a finished hand-off started another child run")

    monkeypatch.setattr(pool, "start_or_rerun_child", no_child)

    @flow
    async def ingest():
        return await pool.numeric_update_on_pool(cfg, 2, items, 0, parent.path, 0, str(export_dir(cfg)), db_id="db")

    record = await ingest()
    target = adapter_dir(export_dir(cfg), 2)
    assert record.path == str(target) and record.parent_path == parent.path
    assert record.rows_used == worker_side.rows_used == 8
    assert (target / "adapter_model.safetensors").read_bytes() == (
        Path(worker_side.path) / "adapter_model.safetensors"
    ).read_bytes()


QWEN_05B = type(
    "Shape", (), {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "vocab_size": 151936}
)


@pytest.mark.parametrize(
    ("setting", "device", "free_gib", "rows", "on", "why"),
    [
        ("auto", "cpu", None, 8, True, "on cpu: memory before speed"),
        ("auto", "cuda:0", 77, 8, False, "not more than half of the 77.0 GiB free"),  # H100: 7.8 GiB peak
        ("auto", "cuda:0", 77, 64, True, "more than half of the 77.0 GiB free"),  # H100: 55.7 GiB peak (34.1 on)
        ("auto", "cuda:0", 6, 8, True, "more than half of the 6.0 GiB free"),  # a small card
        ("auto", "cuda", None, 8, True, "free GPU memory unknown"),
        (False, "cpu", None, 8, False, "hybrid.gradient_checkpointing"),  # as configured, whatever the device
        (True, "cuda:0", 78, 8, True, "hybrid.gradient_checkpointing"),
    ],
)
def test_gradient_checkpointing_is_chosen_for_the_device(setting, device, free_gib, rows, on, why):
    need = hybrid.activation_bytes(QWEN_05B, rows=rows, tokens=330, dtype_bytes=2)
    free = None if free_gib is None else free_gib * hybrid.GIB
    chosen, reason = hybrid.checkpointing_choice(setting, device, free, need)
    assert chosen is on and why in reason


@pytest.mark.parametrize(("rows", "measured_gib"), [(64, 55.7 - 0.9), (8, 7.8 - 0.9)])
def test_the_activation_estimate_is_near_what_an_h100_measured(rows, measured_gib):
    """Rows of 330 tokens of a Qwen2.5-0.5B shape in bf16 without checkpointing: the peak over the weights
    measured by benchmarks/gpu.py on an H100; the estimate within 15% of it."""
    need = hybrid.activation_bytes(QWEN_05B, rows=rows, tokens=330, dtype_bytes=2) / hybrid.GIB
    assert abs(need - measured_gib) < 0.15 * measured_gib


def test_the_numeric_step_logs_its_checkpointing_choice(tiny_model, caplog):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), LoraConfig(r=2, task_type="CAUSAL_LM"))
    examples = [hybrid.Example([1, 2, 3], [4, 5], 1.0)]
    with caplog.at_level("INFO", logger="clgrpo.hybrid"):
        assert hybrid.set_checkpointing(model, examples, HybridConfig(enabled=True)) is True
    assert "gradient checkpointing on (on cpu: memory before speed)" in caplog.text
    assert model.get_base_model().is_gradient_checkpointing
