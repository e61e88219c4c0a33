"""The vLLM backend against a stand-in ``vllm`` module with vLLM's documented offline API (vLLM itself needs a
GPU machine: there it runs with backend 'vllm'; see docs/backends.md)."""

import asyncio
import sys
import types
from dataclasses import dataclass, field

import pytest

from clgrpo.llm import LLMClient
from clgrpo.llm.backends import GenRequest, PermanentLLMError
from clgrpo.llm.local import forget_engines
from schemas.config import ModelConfig

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


@dataclass
class StubState:
    engines: list[dict] = field(default_factory=list)
    chats: list[tuple[list, list]] = field(default_factory=list)


def install_stub_vllm(monkeypatch) -> StubState:
    state = StubState()

    class SamplingParams:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    class StructuredOutputsParams:
        def __init__(self, json=None, **kwargs):
            self.json = json

    class LLM:
        def __init__(self, model, **kwargs):
            state.engines.append({"model": model, **kwargs})

        def chat(self, messages, sampling_params=None, use_tqdm=True):
            state.chats.append((messages, sampling_params))
            outputs = []
            for conversation, params in zip(messages, sampling_params):
                completions = [
                    types.SimpleNamespace(text=f"sample {i}", token_ids=[1] * (i + 2), finish_reason="stop")
                    for i in range(params.n)
                ]
                outputs.append(
                    types.SimpleNamespace(prompt_token_ids=[0] * (3 + len(conversation)), outputs=completions)
                )
            return outputs

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = LLM, SamplingParams
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.StructuredOutputsParams = StructuredOutputsParams
    vllm.sampling_params = sampling
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling)
    return state


@pytest.fixture
def stub(monkeypatch):
    forget_engines()
    yield install_stub_vllm(monkeypatch)
    forget_engines()


def config(**overrides) -> ModelConfig:
    base = {
        "backend": "vllm",
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "seed": 1,
        "engine_options": {"gpu_memory_utilization": 0.8},
    }
    return ModelConfig(**{**base, **overrides})


async def test_n_samples_prefix_caching_and_token_counts(stub):
    client = LLMClient(config())
    sampled = await client.sample(MESSAGES, 4, stage="rollout", temperature=0.6)
    assert sampled.texts == [f"sample {i}" for i in range(4)]
    assert stub.engines == [
        {
            "model": "Qwen/Qwen2.5-7B-Instruct",
            "enable_prefix_caching": True,
            "dtype": "auto",
            "seed": 1,
            "gpu_memory_utilization": 0.8,
        }
    ]
    ((conversations, params),) = stub.chats
    assert conversations == [MESSAGES]  # LLM.chat applies the model's chat template
    p = params[0]
    assert (p.n, p.temperature, p.top_p, p.max_tokens, p.seed, p.structured_outputs) == (4, 0.6, 1.0, 2048, 1, None)
    call = sampled.calls[0]
    assert call.tokens_in == 4 and call.tokens_out == 2 + 3 + 4 + 5
    await client.aclose()


async def test_operations_use_structured_outputs(stub):
    client = LLMClient(config())
    schema = {"type": "object", "properties": {"operations": {"type": "array"}}, "required": ["operations"]}
    await client.complete(MESSAGES, stage="consolidate", json_schema=schema, schema_name="operations")
    params = stub.chats[0][1][0]
    assert params.n == 1 and params.structured_outputs.json == schema
    await client.aclose()


async def test_requests_sent_together_become_one_chat_call(stub):
    client = LLMClient(config())
    prompts = [[{"role": "user", "content": f"problem {i}"}] for i in range(5)]
    await asyncio.gather(*[client.sample(p, 2, stage="rollout") for p in prompts])
    assert len(stub.engines) == 1  # one engine per process and model
    assert sum(len(c[0]) for c in stub.chats) == 5 and len(stub.chats) <= 2
    await client.aclose()


def test_missing_vllm_is_a_clear_permanent_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm -> ImportError
    from clgrpo.llm.vllm_backend import VLLMBackend

    with pytest.raises(PermanentLLMError, match=r"pip install 'clgrpo\[gpu\]'"):
        VLLMBackend(config())


async def test_client_records_the_missing_vllm_without_retrying(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    client = LLMClient(config(max_retries=4))
    sampled = await client.sample(MESSAGES, 2, stage="rollout")
    assert all("needs vLLM" in s.error for s in sampled.failed) and len(sampled.failed) == 2
    assert len(sampled.calls) == 1  # permanent: not retried


async def test_one_bad_request_does_not_fail_the_batch(stub, monkeypatch):
    import vllm

    chat = vllm.LLM.chat

    def picky_chat(self, messages, sampling_params=None, use_tqdm=True):
        if any(m[0]["content"] == "too long" for m in messages):
            raise ValueError("prompt too long")
        return chat(self, messages, sampling_params, use_tqdm)

    monkeypatch.setattr(vllm.LLM, "chat", picky_chat)
    client = LLMClient(config(max_retries=0))
    good, bad = await asyncio.gather(
        client.sample(MESSAGES, 2, stage="rollout"),
        client.sample([{"role": "user", "content": "too long"}], 2, stage="rollout"),
        return_exceptions=True,
    )
    assert good.texts == ["sample 0", "sample 1"]
    assert [s.index for s in bad.failed] == [0, 1] and all("prompt too long" in s.error for s in bad.failed)
    await client.aclose()


def test_sampling_params_request_mapping(stub):
    from clgrpo.llm.vllm_backend import sampling_params

    p = sampling_params(GenRequest(MESSAGES, n=5, temperature=0.0, top_p=0.9, max_tokens=64, seed=None))
    assert (p.n, p.temperature, p.top_p, p.max_tokens, p.seed) == (5, 0.0, 0.9, 64, None)


async def test_an_adapter_is_served_with_a_lora_request(stub, monkeypatch, tmp_path):
    requests = []

    class LoRARequest:
        def __init__(self, name, lora_id, path):
            requests.append((name, lora_id, path))

    lora = types.ModuleType("vllm.lora.request")
    lora.LoRARequest = LoRARequest
    monkeypatch.setitem(sys.modules, "vllm.lora", types.ModuleType("vllm.lora"))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", lora)
    chat = sys.modules["vllm"].LLM.chat

    def chat_with_lora(self, messages, sampling_params=None, use_tqdm=True, lora_request=None):
        assert isinstance(lora_request, LoRARequest)
        return chat(self, messages, sampling_params, use_tqdm)

    monkeypatch.setattr(sys.modules["vllm"].LLM, "chat", chat_with_lora)
    adapter = tmp_path / "adapter_step1"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    client = LLMClient(config(adapter=str(adapter)))
    await client.sample(MESSAGES, 2, stage="rollout")
    assert stub.engines[0]["enable_lora"] is True and stub.engines[0]["max_lora_rank"] == 8
    assert requests == [("clgrpo-adapter", 1, str(adapter))]
    await client.aclose()
    with pytest.raises(PermanentLLMError, match="not a LoRA folder"):
        from clgrpo.llm.vllm_backend import VLLMBackend

        VLLMBackend(config(adapter=str(tmp_path)))
