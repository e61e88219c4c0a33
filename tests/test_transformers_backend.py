"""The transformers backend on a tiny randomly initialised model built offline in the test."""

import asyncio
import json
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from clgrpo.llm import LLMCallError, LLMClient
from clgrpo.llm.backends import GenRequest, PermanentLLMError
from clgrpo.llm.transformers_backend import TransformersBackend, pick_device, pick_dtype
from clgrpo.prompts.consolidate import consolidate_messages
from schemas.config import ModelConfig
from tests.tiny_model import build_tiny_model

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
ENUM_SCHEMA = {
    "type": "object",
    "properties": {"op": {"type": "string", "enum": ["add", "keep"]}},
    "required": ["op"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def backend(tiny_model):
    return TransformersBackend(
        ModelConfig(backend="transformers", model="tiny", model_path=str(tiny_model), device="auto", cpu_threads=1)
    )


@pytest.fixture
def generate_calls(backend, monkeypatch):
    """Records the input ids and outputs of every ``model.generate`` call of the loaded tiny model."""
    loaded = backend.engine.load()
    calls: list[dict] = []
    original = loaded.model.generate

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        calls.append({"input_ids": kwargs["input_ids"].clone(), "output": out.clone()})
        return out

    monkeypatch.setattr(loaded.model, "generate", spy)
    return calls


def run(coro):
    return asyncio.run(coro)


def generated_lengths(call: dict, eos_ids: frozenset[int]) -> list[int]:
    width = call["input_ids"].shape[1]
    lengths = []
    for row in call["output"][:, width:].tolist():
        lengths.append(next((k for k, t in enumerate(row) if t in eos_ids), len(row)))
    return lengths


def test_g_samples_in_one_generate_call_with_token_counts(backend, generate_calls):
    gen = run(backend.generate(GenRequest(MESSAGES, n=4, seed=3, max_tokens=12)))
    assert len(generate_calls) == 1 and generate_calls[0]["input_ids"].shape[0] == 4
    assert len(gen.texts) == 4 and len(gen.finish_reasons) == 4
    loaded = backend.engine.load()
    prompt = loaded.encode(MESSAGES)
    assert gen.tokens_in == len(prompt)  # the shared prompt counts once
    lengths = generated_lengths(generate_calls[0], loaded.eos_ids)
    assert gen.tokens_out == sum(lengths) and all(n <= 12 for n in lengths)  # no padding, no eos counted
    assert [r == "length" for r in gen.finish_reasons] == [n == 12 for n in lengths]


def test_the_models_chat_template_builds_the_prompt(backend, generate_calls):
    run(backend.generate(GenRequest(MESSAGES, n=1, seed=0, max_tokens=2)))
    tokenizer = backend.engine.load().tokenizer
    prompt = tokenizer.decode(generate_calls[0]["input_ids"][0].tolist())
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_seeded_requests_reproduce_alone_and_batched(backend, generate_calls):
    request = GenRequest(MESSAGES, n=3, seed=11, max_tokens=16, temperature=1.0)
    other = GenRequest(
        [{"role": "user", "content": "A different, longer prompt to pad the batch."}], n=2, seed=5, max_tokens=16
    )
    alone = run(backend.generate(request))
    again = run(backend.generate(request))

    async def together():
        return await asyncio.gather(backend.generate(other), backend.generate(request))

    _, batched = run(together())
    assert again.texts == alone.texts and batched.texts == alone.texts
    assert len(set(alone.texts)) > 1  # the G samples differ from each other
    assert generate_calls[-1]["input_ids"].shape[0] == 5  # both requests went into one generate call
    different = run(backend.generate(GenRequest(MESSAGES, n=3, seed=12, max_tokens=16, temperature=1.0)))
    assert different.texts != alone.texts


def test_requests_with_different_limits_share_a_batch(backend, generate_calls):
    async def both():
        return await asyncio.gather(
            backend.generate(GenRequest(MESSAGES, n=2, seed=1, max_tokens=3)),
            backend.generate(GenRequest(MESSAGES, n=2, seed=2, max_tokens=9)),
        )

    short, long = run(both())
    assert len(generate_calls) == 1
    assert short.tokens_out <= 6 and long.tokens_out <= 18
    loaded = backend.engine.load()
    lengths = generated_lengths(generate_calls[0], loaded.eos_ids)
    assert short.tokens_out == sum(lengths[:2]) and long.tokens_out == sum(lengths[2:])


def test_json_schema_is_enforced_by_constrained_decoding(backend):
    pytest.importorskip("llguidance")
    gen = run(
        backend.generate(GenRequest(MESSAGES, n=4, seed=0, max_tokens=40, temperature=1.0, json_schema=ENUM_SCHEMA))
    )
    for text, reason in zip(gen.texts, gen.finish_reasons):
        assert json.loads(text)["op"] in ("add", "keep") and reason == "stop"


def test_greedy_is_deterministic_without_a_seed(backend):
    first = run(backend.generate(GenRequest(MESSAGES, n=2, temperature=0.0, max_tokens=8)))
    second = run(backend.generate(GenRequest(MESSAGES, n=1, temperature=0.0, max_tokens=8)))
    assert first.texts[0] == first.texts[1] == second.texts[0]


def test_device_and_dtype_detection():
    import torch

    expected = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert pick_device("auto") == expected
    assert pick_dtype("auto", "cpu") == "float32" and pick_dtype("float16", "cpu") == "float16"
    with pytest.raises(PermanentLLMError, match="unknown device"):
        pick_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(PermanentLLMError, match="no CUDA GPU"):
            pick_device("cuda")


async def test_client_samples_g_in_one_call_and_records_tokens(tiny_model):
    cfg = ModelConfig(backend="transformers", model="tiny", model_path=str(tiny_model), max_tokens=10, seed=7)
    client = LLMClient(cfg)
    sampled = await client.sample(MESSAGES, 4, stage="rollout")
    assert len(sampled.texts) == 4 and len(sampled.calls) == 1
    call = sampled.calls[0]
    assert call.ok and call.model == "tiny" and call.tokens_in > 0 and 0 < call.tokens_out <= 40
    await client.aclose()


async def test_missing_model_is_a_permanent_error_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("CLGRPO_CACHE", str(tmp_path))
    client = LLMClient(ModelConfig(backend="transformers", model="smol", model_path="embedded", max_retries=3))
    with pytest.raises(LLMCallError, match="clgrpo model fetch") as err:
        await client.complete(MESSAGES, stage="summarize")
    assert len(err.value.calls) == 1 and not err.value.calls[0].ok  # not retried


def test_bounded_operations_schema_makes_the_model_close_the_list(backend):
    pytest.importorskip("llguidance")
    from domains.learner import OPERATIONS_SCHEMA, operations_schema

    schema = operations_schema(1)
    assert schema["properties"]["operations"]["maxItems"] == 1
    assert "maxItems" not in OPERATIONS_SCHEMA["properties"]["operations"]
    assert operations_schema(None) == OPERATIONS_SCHEMA
    gen = run(
        backend.generate(
            GenRequest(
                MESSAGES,
                n=3,
                seed=4,
                max_tokens=200,
                temperature=1.0,
                json_schema={
                    **schema,
                    "properties": {"operations": {**schema["properties"]["operations"], "items": ENUM_SCHEMA}},
                },
            )
        )
    )
    for text in gen.texts:
        assert len(json.loads(text)["operations"]) <= 1


def test_per_operation_schemas_and_a_lesson_pattern_compile_for_constrained_decoding(backend):
    pytest.importorskip("llguidance")
    from domains.learner import GROUP_KINDS, operations_schema

    grammars = backend.engine.load().grammars
    group = operations_schema(3, kinds=GROUP_KINDS, live_ids=["E1"], min_words=5, max_words=24)
    plan = operations_schema(5, live_ids=["E1", "E2"], sources=["p1"], pattern=r'^When [^".?!0-9A-Z\\\n]+\.$')
    assert grammars.matcher(group) is not None and grammars.matcher(plan) is not None  # None: unconstrained


def test_without_llguidance_replies_are_unconstrained(tiny_model, monkeypatch, caplog):
    from transformers import AutoTokenizer

    from clgrpo.llm.transformers_backend import Grammars

    monkeypatch.setitem(sys.modules, "llguidance", None)  # import fails as when the package is missing
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    with caplog.at_level("WARNING"):
        assert Grammars.create(tokenizer, len(tokenizer), [tokenizer.eos_token_id]) is None
    assert "llguidance is not installed" in caplog.text


def test_a_schema_the_grammar_engine_rejects_falls_back_to_unconstrained(backend, caplog):
    pytest.importorskip("llguidance")
    grammars = backend.engine.load().grammars
    with caplog.at_level("WARNING"):
        assert grammars.matcher({"type": "string", "pattern": "("}) is None
    assert "cannot compile the JSON schema" in caplog.text


def test_top_p_keeps_the_smallest_set_reaching_the_mass_per_row():
    import torch

    from clgrpo.llm.transformers_backend import _top_p

    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]] * 3))
    kept = torch.isfinite(_top_p(logits, torch.tensor([0.6, 0.1, 1.0]))).tolist()
    assert kept[0] == [False, True, True]
    assert kept[1] == [False, True, False]  # the top token always stays
    assert kept[2] == [True, True, True]  # top_p 1: every token, whatever the rounding of the sums


def test_rows_sampled_together_draw_from_their_own_distribution():
    """The batched inverse-CDF draw: each row's tokens follow its own probabilities, a greedy row takes its
    argmax, a row with every token masked gets None, and a row's draws do not depend on its neighbours."""
    import torch

    from clgrpo.llm.transformers_backend import Row, RowSampler

    def rows(*temperatures):
        return [Row(0, i, [1], 10, t, 1.0, 7) for i, t in enumerate(temperatures)]

    sampler = RowSampler(rows(1.0, 0.0, 1.0), 1, frozenset({0}), None)
    probs = torch.tensor([0.1, 0.6, 0.3, 0.0])
    masked = torch.full((4,), float("-inf"))
    counts = torch.zeros(4)
    for _ in range(2000):
        first, greedy, none = sampler._draw(
            torch.stack([probs.log(), torch.tensor([0.0, 1.0, 5.0, 2.0]), masked]), sampler.rows
        )
        counts[first] += 1
        assert greedy == 2 and none is None
    assert counts[3] == 0  # a token of probability 0 is never drawn
    assert torch.allclose(counts / counts.sum(), probs, atol=0.04)
    alone = RowSampler(rows(1.0), 1, frozenset({0}), None)
    together = RowSampler(rows(1.0, 1.0), 1, frozenset({0}), None)
    for _ in range(50):
        assert (
            alone._draw(probs.log()[None], alone.rows)[0]
            == together._draw(torch.stack([probs.log(), torch.zeros(4)]), together.rows)[0]
        )


def test_repetition_penalty_lowers_only_tokens_already_generated():
    import torch

    from clgrpo.llm.transformers_backend import _penalize_repeats

    logits = torch.tensor([2.0, -1.0, 3.0, float("-inf")])
    out = _penalize_repeats(logits, torch.tensor([0, 1, 1, 3]), 2.0)
    assert out.tolist() == [1.0, -2.0, 3.0, float("-inf")]  # positive halved, negative doubled, masked stays


def test_a_repetition_penalty_breaks_the_greedy_loop_of_a_tiny_model(backend, generate_calls):
    plain = GenRequest(messages=MESSAGES, n=1, temperature=0.0, max_tokens=24)
    penalized = GenRequest(messages=MESSAGES, n=1, temperature=0.0, max_tokens=24, repetition_penalty=2.0)
    run(backend.generate(plain))
    run(backend.generate(penalized))
    distinct = [len(set(c["output"][0, c["input_ids"].shape[1] :].tolist())) for c in generate_calls]
    assert distinct[1] > distinct[0], distinct  # the random model repeats a few tokens greedily; the penalty spreads


async def test_agent_rollouts_on_a_local_engine_use_the_text_protocol(tiny_model):
    """``protocol: auto`` on the transformers backend is the text protocol (no tool calling in the engine):
    the prompt describes the fenced ```python action and the rollout runs to a final answer."""
    from schemas.config import AgentConfig
    from tasks.agent import agent_rollout, resolve_protocol

    cfg = ModelConfig(backend="transformers", model="tiny", model_path=str(tiny_model), max_tokens=8, seed=3)
    client = LLMClient(cfg)
    agent = AgentConfig(max_turns=2)
    assert resolve_protocol(client, agent) == "text"

    async def no_tool(arguments, context):  # never reached unless the random model writes an action
        from domains import ToolOutput

        return ToolOutput("42")

    from domains import Tool

    tool = Tool(
        "python",
        "Run Python.",
        {"type": "object", "properties": {"code": {"type": "string"}}},
        no_tool,
        text_argument="code",
    )
    outcome = await agent_rollout(
        MESSAGES,
        [tool],
        client,
        agent,
        temperature=0.7,
        seed=3,
        base=dict(problem_id="p", prompt_hash="h", library_version=0, sample_idx=0),
    )
    await client.aclose()
    rollout = outcome.rollout
    assert rollout.error is None and 1 <= rollout.n_turns <= 2 and rollout.final_text
    assert [c.turn for c in outcome.calls] == list(range(rollout.n_turns)) and all(c.ok for c in outcome.calls)


@pytest.fixture(scope="module")
def embedded_backend():
    from clgrpo.models.weights import ModelError, fetch_embedded

    try:
        folder = fetch_embedded(log=lambda _m: None).hf_dir
    except ModelError as exc:
        pytest.skip(f"the embedded model is not cached and cannot be fetched here: {exc}")
    return TransformersBackend(
        ModelConfig(backend="transformers", model="SmolLM2-135M-Instruct", model_path=str(folder), device="cpu")
    )


@pytest.mark.slow
@pytest.mark.parametrize("pattern", [None, r'^When [^".?!0-9A-Z\\\n]+\.$'], ids=["word-bounds", "lesson-pattern"])
def test_the_real_embedded_model_replies_valid_json_under_the_learner_schema(embedded_backend, pattern):
    """Constrained decoding on SmolLM2-135M: every sample closes its JSON, and the JSON is valid under the
    learner's operations schema (kinds, live ids, word bounds or the lesson pattern)."""
    pytest.importorskip("llguidance")
    jsonschema = pytest.importorskip("jsonschema")
    from domains.learner import LearnerPrompts, operations_schema

    schema = operations_schema(1, live_ids=["E1", "E2"], min_words=3, max_words=12, pattern=pattern)
    messages = consolidate_messages(
        LearnerPrompts("arithmetic").ask(min_words=3, max_words=12),
        json.dumps([{"op": "add", "text": "Add the two numbers carefully."}]),
        "",
    )
    gen = run(
        embedded_backend.generate(
            GenRequest(messages, n=3, seed=0, max_tokens=320, temperature=0.7, json_schema=schema)
        )
    )
    assert gen.finish_reasons == ["stop"] * 3, gen.texts
    for text in gen.texts:
        jsonschema.validate(json.loads(text), schema)


QWEN_05B = type(
    "Shape",
    (),
    {"num_hidden_layers": 24, "num_key_value_heads": 2, "num_attention_heads": 14, "hidden_size": 896, "head_dim": 64},
)


@pytest.mark.parametrize(("free_gib", "rows"), [(None, 32), (75, 256), (2, 47), (0.01, 1)])
def test_the_batch_size_comes_from_the_gpu_memory_free_after_loading(free_gib, rows):
    from clgrpo.llm import transformers_backend as tb

    per_row = tb.kv_bytes_per_row(QWEN_05B, dtype_bytes=2, vocab_size=151936)
    assert 25e6 < per_row < 30e6  # 2048 positions of bf16 keys and values, plus the row's float32 logits
    free = None if free_gib is None else int(free_gib * (1 << 30))
    assert tb.rows_that_fit(free, per_row) == rows


def test_the_engine_sizes_its_batches_from_the_loaded_model():
    """An engine whose loaded model decides the batch size takes no more rows than that in one batch."""
    from clgrpo.llm.backends import Generation
    from clgrpo.llm.local import Engine

    batches: list[int] = []

    def run_batch(_model, requests):
        batches.append(sum(r.n for r in requests))
        return [Generation(["ok"] * r.n) for r in requests]

    engine = Engine("sized", load=lambda: "model", run_batch=run_batch, max_rows=32, rows_for=lambda _m: 3)

    async def many():
        return await asyncio.gather(*(engine.generate(GenRequest(MESSAGES, n=1)) for _ in range(7)))

    assert len(asyncio.run(many())) == 7
    assert engine.max_rows == 3 and max(batches) <= 3 and sum(batches) == 7
