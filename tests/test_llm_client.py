"""The LLM client over real HTTP to the fake OpenAI-compatible server."""

import asyncio
import time
from functools import partial

import pytest

from clgrpo.llm import LLMCallError, LLMClient
from clgrpo.llm.backends import OpenAIBackend
from clgrpo.prompts.consolidate import consolidate_messages
from clgrpo.prompts.repair import repair_messages
from clgrpo.testing.fake_openai import ChatRequest, FakeOpenAIServer, Fault, role_of
from domains.learner import OPERATIONS_SCHEMA, LearnerPrompts
from schemas.config import ModelConfig, PriceTable

MESSAGES = [{"role": "user", "content": "Say something."}]


class Echo:
    """Replies 'reply i' per choice; remembers each request's response_format and its body as sent on the wire."""

    def __init__(self) -> None:
        self.formats: list[object] = []
        self.bodies: list[dict] = []

    def __call__(self, request: ChatRequest) -> list[str]:
        self.formats.append(request.response_format)
        self.bodies.append(request.raw)
        return [f"reply {i}" for i in range(request.n)]


class Replies:
    """Serves scripted replies in order (learner role)."""

    def __init__(self, *replies: str) -> None:
        self.replies = list(replies)

    def __call__(self, request: ChatRequest) -> list[str]:
        return [self.replies.pop(0)]


def model(server: FakeOpenAIServer, **overrides) -> ModelConfig:
    base = dict(
        model="fake-model",
        base_url=server.base_url,
        api_key_env=None,
        retry_base_delay_s=0.01,
        retry_max_delay_s=0.05,
        timeout_s=5.0,
        max_retries=3,
    )
    return ModelConfig(**{**base, **overrides})


@pytest.fixture
def echo_server():
    with FakeOpenAIServer(Echo()) as server:
        yield server


async def test_n_samples_in_one_request_with_tokens_and_cost(echo_server):
    cfg = model(echo_server, price=PriceTable(input_per_mtok=1_000_000, output_per_mtok=2_000_000))
    client = LLMClient(cfg)
    sampled = await client.sample(MESSAGES, 4, stage="rollout")
    assert sampled.texts == ["reply 0", "reply 1", "reply 2", "reply 3"]
    assert echo_server.stats.requests == 1 and len(sampled.calls) == 1
    call = sampled.calls[0]
    assert (call.stage, call.role, call.model, call.ok) == ("rollout", "policy", "fake-model", True)
    assert call.tokens_in == 2 and call.tokens_out == 8  # words of prompt / of the 4 replies
    assert call.cost_usd == pytest.approx(2 * 1 + 8 * 2)
    await client.aclose()


async def test_g_separate_calls_when_endpoint_has_no_n(echo_server):
    client = LLMClient(model(echo_server, supports_n=False))
    sampled = await client.sample(MESSAGES, 3, stage="rollout")
    assert len(sampled.texts) == 3 and echo_server.stats.requests == 3 and len(sampled.calls) == 3
    await client.aclose()


async def test_endpoint_that_ignores_n_is_topped_up_and_remembered():
    with FakeOpenAIServer(Echo(), supports_n=False) as server:
        client = LLMClient(model(server, supports_n=True))
        first = await client.sample(MESSAGES, 3, stage="rollout")
        assert len(first.texts) == 3 and server.stats.requests == 3  # 1 with n=3 (got 1) + 2 singles
        server.reset_stats()
        await client.sample(MESSAGES, 3, stage="rollout")
        assert server.stats.requests == 3 and all(e.n == 1 for e in server.stats.log)
        await client.aclose()


async def test_endpoint_that_refuses_n_gets_singles_and_keeps_smaller_n():
    """llama-server answers n above its slot count with HTTP 400: those samples are asked for one per request
    (the refusal recorded), and later requests of that many or more go singly, fewer still together."""
    with FakeOpenAIServer(Echo(), max_n=2) as server:
        client = LLMClient(model(server))
        first = await client.sample(MESSAGES, 3, stage="rollout", seed=10)
        assert first.texts == ["reply 0"] * 3 and not first.failed
        assert [(e.n, e.status) for e in server.stats.log] == [(3, 400), (1, 200), (1, 200), (1, 200)]
        refused = first.calls[0]
        assert not refused.ok and "n=3 refused" in refused.error and "between 1 <= value <= 2" in refused.error
        assert sorted(b["seed"] for b in server.responder.bodies) == [10, 11, 12]  # sample i: seed + i
        server.reset_stats()
        await client.sample(MESSAGES, 4, stage="rollout")
        await client.sample(MESSAGES, 2, stage="rollout")
        assert [e.n for e in server.stats.log] == [1, 1, 1, 1, 2]
        await client.aclose()


async def test_other_refusals_of_a_request_with_n_fail_its_samples(echo_server):
    echo_server.inject(Fault(kind="status", status=400, message="prompt is too long", times=1))
    client = LLMClient(model(echo_server))
    sampled = await client.sample(MESSAGES, 3, stage="rollout")
    assert len(sampled.failed) == 3 and "prompt is too long" in sampled.failed[0].error
    assert echo_server.stats.requests == 1  # not resent singly: only a refused n is
    await client.aclose()


async def test_429_honours_retry_after_and_records_retries(echo_server):
    echo_server.inject(Fault(kind="status", status=429, retry_after=0.3, times=2))
    client = LLMClient(model(echo_server))
    start = time.monotonic()
    done = await client.complete(MESSAGES, stage="summarize")
    assert time.monotonic() - start >= 0.6  # two waits of at least Retry-After
    assert done.text == "reply 0" and done.call.retries == 2 and done.call.ok
    await client.aclose()


async def test_rate_limit_pauses_other_callers(echo_server):
    echo_server.inject(Fault(kind="status", status=429, retry_after=0.4, times=1))
    client = LLMClient(model(echo_server), concurrency=8)
    first = asyncio.create_task(client.complete(MESSAGES, stage="s"))
    await asyncio.sleep(0.1)  # the first call has hit the 429 and set the pause
    started = time.monotonic()
    await client.complete(MESSAGES, stage="s")
    assert time.monotonic() - started >= 0.2
    await first
    await client.aclose()


@pytest.mark.parametrize(
    "fault",
    [
        Fault(kind="status", status=500),
        Fault(kind="status", status=503),
        Fault(kind="drop"),
        Fault(kind="delay", delay_s=1.0),
    ],
)
async def test_transient_failures_are_retried(echo_server, fault):
    echo_server.inject(fault)
    client = LLMClient(model(echo_server, timeout_s=0.5))
    done = await client.complete(MESSAGES, stage="s")
    assert done.text == "reply 0" and done.call.retries == 1
    await client.aclose()


async def test_permanent_error_is_not_retried(echo_server):
    echo_server.inject(Fault(kind="status", status=401, times=5))
    client = LLMClient(model(echo_server))
    with pytest.raises(LLMCallError, match="HTTP 401") as err:
        await client.complete(MESSAGES, stage="consolidate")
    assert echo_server.stats.requests == 1
    assert [c.ok for c in err.value.calls] == [False] and err.value.calls[0].stage == "consolidate"
    await client.aclose()


async def test_gives_up_after_max_retries_with_a_failed_call_record(echo_server):
    echo_server.inject(Fault(kind="status", status=500, times=10))
    client = LLMClient(model(echo_server, max_retries=2))
    sampled = await client.sample(MESSAGES, 2, stage="rollout")
    assert [s.index for s in sampled.failed] == [0, 1]  # the n=2 request failed: both samples, with the cause
    assert all("gave up after 2 retries" in s.error and "HTTP 500" in s.error for s in sampled.failed)
    assert echo_server.stats.requests == 3
    # one record per request, each with its cause; only the last is the call's outcome
    assert [(c.retries, c.ok, c.final) for c in sampled.calls] == [
        (0, False, False),
        (1, False, False),
        (2, False, True),
    ]
    assert all("HTTP 500" in c.error for c in sampled.calls) and len({c.call_id for c in sampled.calls}) == 1
    await client.aclose()


async def test_global_concurrency_limit_reaches_the_server():
    with FakeOpenAIServer(Echo(), latency=lambda _r: 0.2) as server:
        client = LLMClient(model(server), concurrency=5)
        await asyncio.gather(*[client.complete(MESSAGES, stage="s") for _ in range(20)])
        assert server.stats.max_in_flight == 5
        await client.aclose()


async def test_a_call_records_its_wait_for_a_turn_apart_from_its_latency():
    """started_at is when a call was made; waited_s its wait under the concurrency limit; it ended at started_at +
    waited_s + latency_s: two calls made together through one slot are recorded back to back, not overlapping."""
    with FakeOpenAIServer(Echo(), latency=lambda _r: 0.3) as server:
        client = LLMClient(model(server), concurrency=1)
        first, second = await asyncio.gather(*[client.sample(MESSAGES, 1, stage="s") for _ in range(2)])
        await client.aclose()
    calls = sorted(first.calls + second.calls, key=lambda c: c.waited_s)
    assert calls[0].waited_s < 0.1 and calls[1].waited_s >= 0.25
    assert all(c.latency_s >= 0.25 for c in calls)  # the wait is not in the latency
    ends = [(c.started_at - calls[0].started_at).total_seconds() + c.waited_s + c.latency_s for c in calls]
    sent_second = (calls[1].started_at - calls[0].started_at).total_seconds() + calls[1].waited_s
    assert sent_second >= ends[0] - 0.05 and ends[1] >= 0.55


async def test_json_schema_requested_and_dropped_when_disabled(echo_server):
    responder = Echo()
    with FakeOpenAIServer(responder) as server:
        client = LLMClient(model(server, json_schema=True))
        await client.complete(MESSAGES, stage="s", json_schema=OPERATIONS_SCHEMA, schema_name="operations")
        client_plain = LLMClient(model(server, json_schema=False))
        await client_plain.complete(MESSAGES, stage="s", json_schema=OPERATIONS_SCHEMA)
        assert responder.formats[0]["type"] == "json_schema"
        assert responder.formats[0]["json_schema"]["name"] == "operations"
        assert responder.formats[1] is None
        await client.aclose()
        await client_plain.aclose()


async def test_operations_with_one_repair_re_ask():
    good = '{"operations": [{"op": "add", "text": "Check units."}]}'
    with FakeOpenAIServer(Replies("I would add a lesson.", good)) as server:
        client = LLMClient(model(server))
        reply = await client.complete_operations(
            MESSAGES,
            stage="group_advantage",
            json_schema=OPERATIONS_SCHEMA,
            repair=partial(repair_messages, LearnerPrompts().ask()),
        )
        assert reply.parse_error is None and [o.text for o in reply.operations] == ["Check units."]
        assert len(reply.calls) == 2 and server.stats.requests == 2
        await client.aclose()


async def test_a_reply_cut_off_at_max_tokens_gets_a_fresh_draw_not_a_repair():
    looping = '{"operations": [{"op": "add", "text": "When a box with ' + "a box with " * 40
    good = '{"operations": [{"op": "add", "text": "Check units."}]}'
    asked: list[list[dict]] = []

    def responder(request: ChatRequest) -> list[str]:
        asked.append(request.messages)
        return [looping if len(asked) == 1 else good]

    with FakeOpenAIServer(responder) as server:
        client = LLMClient(model(server, max_tokens=64, seed=3))
        reply = await client.complete_operations(
            MESSAGES,
            stage="group_advantage",
            json_schema=OPERATIONS_SCHEMA,
            repair=partial(repair_messages, LearnerPrompts().ask()),
        )
        await client.aclose()
    assert [o.text for o in reply.operations] == ["Check units."] and len(reply.calls) == 2
    assert asked[1] == asked[0]  # the same prompt again, without the looping reply in it


async def test_operations_still_unparseable_are_returned_with_raw_text():
    with FakeOpenAIServer(Replies("no json here", "still none")) as server:
        client = LLMClient(model(server))
        reply = await client.complete_operations(
            MESSAGES,
            stage="consolidate",
            json_schema=OPERATIONS_SCHEMA,
            repair=partial(repair_messages, LearnerPrompts().ask()),
        )
        assert reply.operations == [] and "unparseable after repair" in reply.parse_error
        assert "no json here" in reply.raw_text and "still none" in reply.raw_text
        await client.aclose()


def test_missing_api_key_for_the_official_endpoint_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("SOME_UNSET_KEY", raising=False)
    from clgrpo.llm.backends import PermanentLLMError

    with pytest.raises(PermanentLLMError, match=r"no API key; set \$SOME_UNSET_KEY"):
        OpenAIBackend(ModelConfig(model="gpt", base_url=None, api_key_env="SOME_UNSET_KEY"))


def test_role_detection_of_learner_prompts():
    messages = consolidate_messages(LearnerPrompts("math").ask(min_words=5, max_words=32), "{}", "")
    assert role_of(ChatRequest(model="m", messages=messages)) == "library consolidator"


async def test_repetition_penalty_is_sent_only_when_set():
    seen: list[dict] = []

    def responder(request: ChatRequest) -> list[str]:
        seen.append(request.raw)
        return ["ok"] * request.n

    with FakeOpenAIServer(responder) as server:
        for penalty in (None, 1.1):
            client = LLMClient(model(server, repetition_penalty=penalty))
            await client.complete(MESSAGES, stage="s", role="policy")
            await client.aclose()
    assert "repetition_penalty" not in seen[0] and seen[1]["repetition_penalty"] == 1.1


async def test_request_body_on_the_wire_is_what_the_openai_sdk_sends():
    """clgrpo sends its own JSON instead of going through the openai SDK (a tenth of the CPU per call): the body
    must stay the SDK's, field for field, for every kind of request the stages make."""
    import openai

    raw = Echo()
    tools = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object"}}}]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "operations", "schema": schema, "strict": False}}
    kinds = [
        dict(n=5, seed=3),
        dict(n=1, seed=None, repetition_penalty=1.1),
        dict(n=1, seed=7, tools=tools, tool_choice="none"),
        dict(n=1, seed=None, json_schema=schema),
    ]
    with FakeOpenAIServer(raw) as server:
        backend = OpenAIBackend(model(server, json_schema=True))
        sdk = openai.AsyncOpenAI(api_key="x", base_url=server.base_url, max_retries=0)
        from clgrpo.llm.backends import GenRequest

        for kind in kinds:
            request = GenRequest(
                messages=MESSAGES, temperature=0.6, top_p=0.9, max_tokens=64, schema_name="operations", **kind
            )
            await backend.generate(request)
            sdk_kwargs = dict(
                model="fake-model", messages=MESSAGES, n=request.n, temperature=0.6, top_p=0.9, max_tokens=64
            )
            if request.seed is not None:
                sdk_kwargs["seed"] = request.seed
            if request.repetition_penalty is not None:
                sdk_kwargs["extra_body"] = {"repetition_penalty": request.repetition_penalty}
            if request.tools:
                sdk_kwargs.update(tools=request.tools, tool_choice=request.tool_choice)
            if request.json_schema is not None:
                sdk_kwargs["response_format"] = response_format
            await sdk.chat.completions.create(**sdk_kwargs)
        await backend.aclose()
        await sdk.close()
    ours, theirs = raw.bodies[0::2], raw.bodies[1::2]
    assert len(ours) == len(kinds)
    for mine, sdk_body in zip(ours, theirs):
        assert mine == sdk_body


def test_a_loop_that_ends_without_closing_the_client_logs_nothing(capfd, caplog):
    """Stages run on event loops that end without ``aclose()``: the HTTP session left behind is released
    quietly (no 'Unclosed client session' on a user's terminal)."""
    import gc

    with FakeOpenAIServer(Echo()) as server:
        client = LLMClient(model(server))
        asyncio.run(client.complete(MESSAGES, stage="summarize"))
        del client
        gc.collect()
    out, err = capfd.readouterr()
    assert "Unclosed" not in out + err + caplog.text


def test_llama_cpp_multi_choice_usage_is_completed_for_every_choice():
    """llama-server's usage of a request with n choices counts choice 0 alone (measured: n=4, choices of 399,
    345, 33 and 281 characters, completion_tokens 80 = choice 0's); the others are estimated at its tokens per
    character. A reply without llama.cpp's ``timings`` is taken as it says."""
    from clgrpo.llm.backends import generation

    def reply(texts: list[str], completion_tokens: int, **extra) -> dict:
        choices = [{"index": i, "message": {"role": "assistant", "content": t}} for i, t in enumerate(texts)]
        return {"choices": choices, "usage": {"prompt_tokens": 9, "completion_tokens": completion_tokens}, **extra}

    texts = ["a" * 400, "b" * 200, "c" * 100]
    assert generation(reply(texts, 80, timings={"predicted_n": 80}), "x").tokens_out == 80 + 40 + 20
    assert generation(reply(texts, 140), "x").tokens_out == 140  # OpenAI, vLLM: already the sum
    assert generation(reply(["a" * 40], 10, timings={}), "x").tokens_out == 10
