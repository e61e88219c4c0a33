"""Agent rollouts (tasks/agent.py): the ReAct loop over real HTTP to the scripted server, both tool protocols,
the final-answer rule, timeouts, tool errors, and the trajectory the learner sees.

The loop tests use a stand-in ``python`` tool (it evaluates ``print(a OP b)`` itself) so they test the loop,
not the sandbox; tests/test_agent_flow.py runs the real sandboxed interpreter under the Prefect harness."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

from clgrpo.llm import LLMClient
from clgrpo.prompts.attempts import clip, tool_trace, trajectory_text
from clgrpo.prompts.extract import extract_messages
from clgrpo.prompts.math_rollout import rollout_messages
from clgrpo.prompts.summarize import summarize_messages
from clgrpo.sandbox.isolation import isolation_problem
from clgrpo.testing.fake_openai import ChatRequest, FakeOpenAIServer, Reply
from clgrpo.testing.scripted_llm import FAMILIES, ScriptedWorld, problem_text
from domains import Tool, ToolContext, ToolFailure, ToolOutput
from domains.learner import LearnerPrompts
from schemas.config import AgentConfig, ModelConfig
from schemas.records import Problem
from tasks.agent import (
    _NO_TOOL_CALLING,
    LAST_TURN_NOTE,
    agent_messages,
    agent_rollout,
    parse_text_action,
    tool_call_in_text,
)

PROBLEM = Problem(problem_id="products-000", problem=problem_text(FAMILIES[1], 47, 23), answer=str(47 * 23))
_PRINT_RE = re.compile(r"print\((\d+) ([-+*%]) (\d+)\)\s*$")


async def fake_python(arguments: dict[str, Any], context: ToolContext) -> ToolOutput:
    match = _PRINT_RE.search(arguments["code"].strip())
    if match is None:
        return ToolOutput("", error="SyntaxError: '(' was never closed (line 1)")
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return ToolOutput(str({"+": a + b, "-": a - b, "*": a * b, "%": a % b}[op]))


PYTHON = Tool(
    "python",
    "Run Python.",
    {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    fake_python,
    text_argument="code",
)


def client(server: FakeOpenAIServer, **model: Any) -> LLMClient:
    cfg = ModelConfig(
        model="scripted",
        base_url=server.base_url,
        api_key_env=None,
        max_tokens=256,
        retry_base_delay_s=0.01,
        retry_max_delay_s=0.02,
        timeout_s=10,
        **model,
    )
    return LLMClient(cfg, concurrency=8)


async def run_agent(server: FakeOpenAIServer, agent: AgentConfig, tools: list[Tool] = (PYTHON,), **model: Any):
    llm = client(server, **model)
    try:
        return await agent_rollout(
            rollout_messages(PROBLEM, ""),
            list(tools),
            llm,
            agent,
            base=dict(problem_id=PROBLEM.problem_id, prompt_hash="h", library_version=0, sample_idx=0),
            temperature=0.7,
            seed=1,
        )
    finally:
        await llm.aclose()


def always_tool_world() -> ScriptedWorld:
    return ScriptedWorld(seed=3, p_base=1.0, p_lesson=1.0)


# --- the text protocol ----------------------------------------------------------------------------------
def test_text_protocol_actions():
    tools = {"python": PYTHON}
    said, action = parse_text_action("Let me check.\n```python\nx = 2\nprint(x)\n```\nIt prints 2.", tools, 0)
    assert said.endswith("```") and "It prints 2" not in said  # text after the action is dropped
    assert action.name == "python" and action.arguments == {"code": "x = 2\nprint(x)\n"}
    _, tagged = parse_text_action('<tool name="python">{"code": "print(1)"}</tool>', tools, 1)
    assert tagged.arguments == {"code": "print(1)"}
    _, raw = parse_text_action('<tool name="python">\nprint(1)\n</tool>', tools, 1)
    assert raw.arguments == {"code": "print(1)"}  # a tool with a text argument takes a bare body
    _, bad = parse_text_action('<tool name="python">{"code": </tool>', tools, 1)
    assert bad.arguments is None and "not valid JSON" in bad.problem
    assert parse_text_action("```text\nnot code\n```\nThe answer is \\boxed{3}.", tools, 0) is None
    assert parse_text_action("The answer is \\boxed{3}.", tools, 0) is None
    _, first = parse_text_action('<tool name="other">{}</tool>\n```python\nprint(2)\n```', tools, 0)
    assert first.name == "other"  # the first action counts


def test_tool_instructions_keep_the_prompt_prefix_shared():
    a = agent_messages(rollout_messages(PROBLEM, "[E0]. A lesson."), [PYTHON], "text", 4)
    other = Problem(problem_id="x", problem="Compute 1 + 1.", answer="2")
    b = agent_messages(rollout_messages(other, "[E0]. A lesson."), [PYTHON], "text", 4)
    assert a[0] == b[0] and "```python" in a[0]["content"]  # the system message is problem-independent
    assert "at most 4 replies" in agent_messages(rollout_messages(PROBLEM, ""), [PYTHON], "tools", 4)[0]["content"]


def test_shown_results_keep_head_and_tail():
    text = "".join(f"line {i}\n" for i in range(1000))
    visible = clip(text, 300)  # what the model is shown of a long tool result
    assert len(visible) < 400 and visible.startswith("line 0") and "line 999" in visible
    assert "characters cut" in visible


# --- the loop over HTTP ---------------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", ["tools", "text"])
async def test_agent_computes_with_the_tool(protocol):
    with FakeOpenAIServer(always_tool_world()) as server:
        outcome = await run_agent(server, AgentConfig(protocol=protocol, max_turns=4))
        requests = server.stats.log
    rollout = outcome.rollout
    assert rollout.error is None and f"\\boxed{{{47 * 23}}}" in rollout.final_text
    kinds = [t.kind for t in rollout.turns]
    assert kinds[:3] == ["assistant", "tool_call", "tool_result"] and kinds[-1] == "assistant"
    assert rollout.tool_calls == rollout.n_turns - 1 and rollout.n_turns >= 2
    # every turn is one recorded request, numbered
    assert len(outcome.calls) == len(requests) == rollout.n_turns
    assert [c.turn for c in outcome.calls] == list(range(rollout.n_turns))
    assert all(c.stage == "rollout" and c.role == "policy" for c in outcome.calls)
    assert rollout.tokens_in == sum(c.tokens_in for c in outcome.calls)


async def test_tool_calling_sends_tools_and_tool_messages():
    seen: list[ChatRequest] = []
    world = always_tool_world()

    def responder(request: ChatRequest):
        seen.append(request)
        return world(request)

    with FakeOpenAIServer(responder) as server:
        outcome = await run_agent(server, AgentConfig(protocol="tools", max_turns=4))
    assert outcome.rollout.error is None
    assert seen[0].tools and seen[0].tools[0]["function"]["name"] == "python"
    second = seen[1].messages
    assert second[-2]["role"] == "assistant" and second[-2]["tool_calls"][0]["function"]["name"] == "python"
    assert second[-1]["role"] == "tool" and second[-1]["tool_call_id"] == second[-2]["tool_calls"][0]["id"]
    assert second[-1]["content"] == str(47 * 23)


async def test_tool_errors_are_shown_and_the_rollout_goes_on():
    script = [
        Reply("Computing.", (("nope", {}),)),  # an unknown tool
        Reply("Again.", (("python", {"code": "print(47 * 23"}),)),  # a syntax error
        Reply("Fixing it.", (("python", {"code": "print(47 * 23)"}),)),
    ]

    def responder(request: ChatRequest):
        results = [m for m in request.messages if m["role"] == "tool"]
        if len(results) < len(script):
            return [script[len(results)]]
        return [f"So \\boxed{{{results[-1]['content']}}}."]

    with FakeOpenAIServer(responder) as server:
        outcome = await run_agent(server, AgentConfig(protocol="tools", max_turns=5))
    rollout = outcome.rollout
    results = [t for t in rollout.turns if t.kind == "tool_result"]
    assert [r.error is not None for r in results] == [True, True, False]
    assert "unknown tool 'nope'" in results[0].error and "SyntaxError" in results[1].error
    assert rollout.tool_errors == 2 and rollout.tool_calls == 3 and rollout.error is None
    assert rollout.final_text == f"So \\boxed{{{47 * 23}}}."


async def test_the_last_turn_must_answer():
    requests: list[ChatRequest] = []

    def responder(request: ChatRequest):  # a model that never stops calling tools
        requests.append(request)
        return (
            [Reply("More.", (("python", {"code": "print(1 + 1)"}),))]
            if request.raw.get("tool_choice") != "none"
            else ["Out of turns: \\boxed{2}."]
        )

    with FakeOpenAIServer(responder) as server:
        outcome = await run_agent(server, AgentConfig(protocol="tools", max_turns=3))
    assert outcome.rollout.n_turns == 3 and outcome.rollout.tool_calls == 2
    assert requests[-1].raw["tool_choice"] == "none" and requests[-1].messages[-1]["content"] == LAST_TURN_NOTE
    assert outcome.rollout.final_text == "Out of turns: \\boxed{2}."


async def test_an_endpoint_without_tool_calling_gets_the_text_protocol():
    _NO_TOOL_CALLING.clear()
    with FakeOpenAIServer(always_tool_world(), supports_tools=False) as server:
        outcome = await run_agent(server, AgentConfig(protocol="auto", max_turns=4))
        later = await run_agent(server, AgentConfig(protocol="auto", max_turns=4))
        log = server.stats.log
    assert outcome.rollout.error is None and f"\\boxed{{{47 * 23}}}" in outcome.rollout.final_text
    refused = [c for c in outcome.calls if not c.ok]
    assert len(refused) == 1 and "tool calling refused" in refused[0].error  # recorded, not hidden
    assert log[0].status == 400 and all(e.status == 200 for e in log[1:])
    assert all(c.ok for c in later.calls)  # remembered: no second refusal
    _NO_TOOL_CALLING.clear()


def test_a_tool_call_written_as_text_is_recognised():
    names = {"python"}
    assert tool_call_in_text('{"name": "python", "arguments": {"code": "print(1)"}}', names)
    assert tool_call_in_text('I will compute.\n```json\n{"name": "python", "parameters": {"code": "x"}}\n```', names)
    assert tool_call_in_text('<tool_call>\n{"function": {"name": "python", "arguments": "{}"}}\n</tool_call>', names)
    assert tool_call_in_text(
        '{"tool_calls": [{"type": "function", "function": {"name": "python", "arguments": {}}}]}', names
    )
    assert not tool_call_in_text('{"name": "search", "arguments": {}}', names)  # not one of the tools
    assert not tool_call_in_text('The set {1, 2} has \\boxed{2} elements; {"name": "python"} alone is no call.', names)


async def test_an_endpoint_that_writes_tool_calls_as_text_gets_the_text_protocol():
    """llama-cpp-python's server: a ``tools`` request gets HTTP 200, no ``tool_calls``, the call as JSON text."""
    _NO_TOOL_CALLING.clear()
    world = always_tool_world()
    offered: list[bool] = []  # per request: were tools offered

    def responder(request: ChatRequest):
        offered.append(bool(request.raw.get("tools")))
        if offered[-1]:
            return ['{"name": "python", "arguments": {"code": "print(47 * 23)"}}']
        return world(request)

    with FakeOpenAIServer(responder) as server:
        outcome = await run_agent(server, AgentConfig(protocol="auto", max_turns=4))
        later = await run_agent(server, AgentConfig(protocol="auto", max_turns=4))
    assert outcome.rollout.error is None and f"\\boxed{{{47 * 23}}}" in outcome.rollout.final_text
    assert outcome.rollout.tool_calls >= 1  # the text protocol ran the tool
    assert outcome.calls[0].ok and outcome.calls[0].turn == 0 and len(outcome.calls) > outcome.rollout.n_turns
    assert offered[0] and not any(offered[1:])  # one tools request, then text, remembered for the next rollout
    assert len(later.calls) == later.rollout.n_turns
    _NO_TOOL_CALLING.clear()


async def test_a_slow_turn_fails_the_rollout_with_its_cause():
    with FakeOpenAIServer(always_tool_world(), latency=lambda r: 0.0 if len(r.messages) == 2 else 2.0) as server:
        outcome = await run_agent(server, AgentConfig(protocol="tools", max_turns=4, turn_timeout_s=0.5))
    rollout = outcome.rollout
    assert rollout.error is not None and "turn_timeout_s=0.5" in rollout.error and "turn 1" in rollout.error
    assert [t.kind for t in rollout.turns][:3] == ["assistant", "tool_call", "tool_result"]  # kept for inspection
    cancelled = [c for c in outcome.calls if not c.ok]
    assert len(cancelled) == 1 and "cancelled" in cancelled[0].error and cancelled[0].turn == 1


async def test_an_unavailable_tool_fails_the_rollout():
    async def broken(arguments, context):
        raise ToolFailure("python tool unavailable: no seccomp")

    tool = Tool("python", "Run Python.", PYTHON.parameters, broken, text_argument="code")
    with FakeOpenAIServer(always_tool_world()) as server:
        outcome = await run_agent(server, AgentConfig(protocol="tools"), tools=[tool])
    assert outcome.rollout.error == "python tool unavailable: no seccomp"


async def test_resources_are_closed_when_the_rollout_ends():
    events: list[str] = []

    class Session:
        async def __aenter__(self):
            events.append("open")
            return self

        async def __aexit__(self, *exc):
            events.append("close")

    async def counting(arguments, context):
        await context.resource("session", Session)
        await context.resource("session", Session)  # the same one within a rollout
        return await fake_python(arguments, context)

    tool = Tool("python", "Run Python.", PYTHON.parameters, counting, text_argument="code")
    with FakeOpenAIServer(always_tool_world()) as server:
        outcomes = await asyncio.gather(
            *[run_agent(server, AgentConfig(protocol="tools"), tools=[tool]) for _ in range(3)]
        )
    assert all(o.rollout.error is None for o in outcomes)
    assert events.count("open") == events.count("close") == 3


# --- what the learner sees ------------------------------------------------------------------------------
async def test_the_learner_sees_tool_calls_and_results():
    with FakeOpenAIServer(always_tool_world()) as server:
        rollout = (await run_agent(server, AgentConfig(protocol="tools"))).rollout
    text, trace = trajectory_text(rollout.turns), tool_trace(rollout.turns)
    assert "[python call]" in text and "print(47 * 23)" in text and f"[python result]\n{47 * 23}" in text
    assert trace.startswith("- python: print(47 * 23)") and trace.endswith(str(47 * 23))
    prompts = LearnerPrompts(domain="arithmetic")
    from clgrpo.prompts.attempts import Attempt

    attempt = Attempt(0, text, 1.0, tools=trace)
    summarize = summarize_messages(prompts.ask(use_groundtruth=True), PROBLEM, attempt, "")
    assert "tool use" in summarize[0]["content"].lower() and "[python call]" in summarize[1]["content"]
    extract = extract_messages(
        prompts.ask(use_groundtruth=True, max_ops=2, min_words=5, max_words=30),
        PROBLEM,
        [Attempt(0, "It computed with Python.", 1.0, tools=trace)],
        "",
    )
    assert "Tool calls:\n- python: print(47 * 23)" in extract[1]["content"]
    direct = summarize_messages(prompts.ask(use_groundtruth=True), PROBLEM, Attempt(0, "The answer is 3.", 0.0), "")
    assert "tool use" not in direct[0]["content"].lower()  # direct attempts: the prompt is unchanged


def test_long_tool_parts_are_cut_for_the_learner():
    from schemas.records import Turn

    turns = [
        Turn(kind="assistant", content="Go.", turn=0),
        Turn(kind="tool_call", content=json.dumps({"code": "print('x' * 10**6)"}), tool_name="python", call_id="c"),
        Turn(kind="tool_result", content="x" * 20_000, tool_name="python", call_id="c", truncated=True),
        Turn(kind="assistant", content="\\boxed{1}", turn=1),
    ]
    text = trajectory_text(turns)
    assert len(text) < 1000 and "characters cut" in text and "(output cut)" in text and text.endswith("\\boxed{1}")


async def test_the_readme_tool_example_works_without_touching_flows_or_tasks():
    """docs/agent.md "Tools of your own domain": the example domain registers, lists both tools, and its tool runs in
    an agent rollout (text protocol, tag form)."""
    from pathlib import Path

    from domains import get_domain

    page = (Path(__file__).resolve().parents[1] / "docs" / "agent.md").read_text()
    section = page.split("## Tools of your own domain", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/agent.md", "exec"), {})
    domain = get_domain("physics")
    assert [t.name for t in domain.tools()] == ["python", "constant"]

    def responder(request: ChatRequest):
        if request.messages[-1]["content"].startswith("<tool_result"):
            return [f"So \\boxed{{{request.messages[-1]['content'].split(chr(10))[1]}}}."]
        return ['I look it up. <tool name="constant">{"name": "c"}</tool>']

    with FakeOpenAIServer(responder) as server:
        llm = client(server)
        try:
            outcome = await agent_rollout(
                domain.rollout_messages(PROBLEM, ""),
                domain.tools(),
                llm,
                AgentConfig(protocol="text"),
                base=dict(problem_id="p", prompt_hash="h", library_version=0, sample_idx=0),
                temperature=0.0,
                seed=None,
            )
        finally:
            await llm.aclose()
    assert outcome.rollout.final_text == "So \\boxed{299792458 m/s}."
    assert [t.tool_name for t in outcome.rollout.turns if t.kind == "tool_result"] == ["constant"]


@pytest.mark.skipif(isolation_problem() is not None, reason=str(isolation_problem()))
async def test_the_samples_of_a_group_get_their_own_seeds():
    """A seeded endpoint must not return G identical first replies: sample i uses seed + i, as direct
    single requests do (the problem's seed in evaluation, else the policy's)."""
    from clgrpo.experience.library import ExperienceLibrary
    from domains import get_domain
    from tasks.rollout import rollout_problem

    seeds: list[int | None] = []
    world = always_tool_world()

    def responder(request: ChatRequest):
        if len(request.messages) == 2:
            seeds.append(request.seed)
        return world(request)

    with FakeOpenAIServer(responder) as server:
        llm = client(server, seed=100)
        try:
            batch = await rollout_problem(
                PROBLEM, ExperienceLibrary(), get_domain("math"), llm, 4, 0.7, agent=AgentConfig(protocol="tools")
            )
        finally:
            await llm.aclose()
    assert sorted(seeds) == [100, 101, 102, 103] and len(batch.rollouts) == 4
