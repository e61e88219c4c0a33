"""Agent rollouts: a ReAct loop over the one LLM client, with the domain's tools (``Domain.tools()``).

Each turn is one policy call (an ``LLMCall`` of stage ``rollout`` with its ``turn``). A reply that calls a tool
gets the tool's result and another turn; a reply without a tool call is the final answer, graded like a direct
answer. The last turn (``agent.max_turns``) is told to answer now; whatever it replies is final and any tool
call in it is not run.

Two protocols (``agent.protocol``):
- ``tools``: OpenAI tool calling: the request lists the tools, the reply's ``tool_calls`` are run, results go
  back as ``tool`` messages.
- ``text``: for models and servers without tool calling: the reply names one action in plain text, either a
  fenced block named after a tool with a text argument (```python ... ```) or ``<tool name="NAME">{JSON
  arguments}</tool>``. The first action is run; text after it is dropped (a model writing its own "output"
  must not be believed); the result comes back as a user message inside ``<tool_result>``.
``auto`` uses ``tools`` for OpenAI-compatible endpoints and ``text`` for the local engines; an endpoint that
refuses ``tools``, or that accepts them but answers with the call written as JSON text and no ``tool_calls``
(llama-cpp-python's server does), switches this process to ``text`` for that model and the rollout starts
over (the refused or ignored request is recorded).

A rollout whose model call failed after its retries, that ran past ``turn_timeout_s`` / ``rollout_timeout_s``,
or whose tool could not work at all (``ToolFailure``) is a failed rollout (``error`` set, its turns kept): not
graded, counted against the rollout tolerance, redone by a retry. A tool error the code caused (an exception, a
limit) is part of the attempt: the model sees it and goes on.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from clgrpo.llm import LLMClient
from clgrpo.llm.backends import ToolCall, ToolsRefused
from clgrpo.llm.client import LLMCallError
from clgrpo.prompts.agent import LAST_TURN_NOTE, TOOL_RESULT_TEMPLATE, agent_messages
from clgrpo.prompts.attempts import clip
from domains.base import Message, Tool, ToolContext, ToolFailure, ToolOutput
from schemas.config import AgentConfig
from schemas.records import LLMCall, Rollout, Turn

Protocol = Literal["tools", "text"]

_FENCE_RE = re.compile(r"```([A-Za-z0-9_-]+)[ \t]*\n(.*?)```", re.DOTALL)
_TAG_RE = re.compile(r'<tool\s+name\s*=\s*"([^"]+)"\s*>(.*?)</tool>', re.DOTALL)

# protocol "tools" refused by an endpoint: (model, base_url) pairs that use "text" from then on
_NO_TOOL_CALLING: set[tuple[str, str | None]] = set()


class ToolsIgnored(Exception):
    """A ``tools`` request came back without ``tool_calls`` but with a tool call written as text: the endpoint
    does not do tool calling (it only showed the model the tools)."""


def tool_call_in_text(text: str, tool_names: set[str]) -> bool:
    """Whether ``text`` holds a tool call written as JSON: ``{"name": TOOL, "arguments"|"parameters": ...}``,
    possibly under ``function`` or ``tool_calls``, in a code fence or ``<tool_call>`` tags or bare."""
    decoder = json.JSONDecoder()
    for start in (m.start() for m in re.finditer(r"[{\[]", text)):
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if _names_a_tool(value, tool_names):
            return True
    return False


def _names_a_tool(value: Any, tool_names: set[str]) -> bool:
    if isinstance(value, list):
        return any(_names_a_tool(v, tool_names) for v in value)
    if not isinstance(value, dict):
        return False
    if value.get("name") in tool_names and ("arguments" in value or "parameters" in value):
        return True
    return any(_names_a_tool(value.get(key), tool_names) for key in ("function", "tool_calls", "tool_call"))


@dataclass(frozen=True)
class Action:
    """A tool call the model asked for, in either protocol."""

    call_id: str
    name: str
    arguments_text: str  # as written by the model (JSON for tool calling and tags; code for a fenced block)
    arguments: dict[str, Any] | None  # None: not a JSON object (see ``problem``)
    problem: str | None = None  # why the arguments are unusable


@dataclass
class AgentOutcome:
    rollout: Rollout
    calls: list[LLMCall] = field(default_factory=list)


# --- tool results ------------------------------------------------------------------------------------
def result_text(output: ToolOutput) -> str:
    """The text a tool result stands for: its output, then its error line."""
    error = f"Error: {output.error}" if output.error else ""
    return "\n".join(part for part in (output.text.rstrip(), error) if part) or "(no output)"


# --- the text protocol ----------------------------------------------------------------------------------
def parse_text_action(text: str, tools: dict[str, Tool], turn: int) -> tuple[str, Action] | None:
    """The first action in a reply and the reply up to its end, or None for a final answer. Fenced blocks
    count only for tools with a text argument (a ```text or ```latex block is prose)."""
    candidates = []
    for match in _FENCE_RE.finditer(text):
        tool = tools.get(match.group(1).lower())
        if tool is not None and tool.text_argument:
            code = match.group(2)
            candidates.append((match, Action(f"text-{turn}", tool.name, code, {tool.text_argument: code})))
            break
    if (match := _TAG_RE.search(text)) is not None:
        candidates.append((match, _tag_action(match.group(1).strip(), match.group(2), tools, turn)))
    if not candidates:
        return None
    match, action = min(candidates, key=lambda c: c[0].start())
    return text[: match.end()], action


def _tag_action(name: str, body: str, tools: dict[str, Tool], turn: int) -> Action:
    call_id = f"text-{turn}"
    stripped = body.strip()
    try:
        arguments = json.loads(stripped) if stripped.startswith("{") else None
    except json.JSONDecodeError as exc:
        return Action(call_id, name, body, None, f"the arguments are not valid JSON: {exc}")
    if arguments is None:
        tool = tools.get(name)
        if tool is not None and tool.text_argument:
            return Action(call_id, name, body, {tool.text_argument: body.strip("\n")})
        return Action(call_id, name, body, None, "the arguments must be a JSON object")
    return Action(call_id, name, body, arguments)


def _tool_calling_action(call: ToolCall) -> Action:
    try:
        arguments = json.loads(call.arguments or "{}")
    except json.JSONDecodeError as exc:
        return Action(call.call_id, call.name, call.arguments, None, f"the arguments are not valid JSON: {exc}")
    if not isinstance(arguments, dict):
        return Action(call.call_id, call.name, call.arguments, None, "the arguments must be a JSON object")
    return Action(call.call_id, call.name, call.arguments, arguments)


# --- the loop -------------------------------------------------------------------------------------------
def resolve_protocol(llm: LLMClient, agent: AgentConfig) -> Protocol:
    cfg = llm.configs["policy"]
    if agent.protocol != "auto":
        return agent.protocol
    if cfg.backend != "openai" or (cfg.model, cfg.base_url) in _NO_TOOL_CALLING:
        return "text"
    return "tools"


class AgentLoop:
    """One rollout: turns until a final answer, the turn limit, a timeout or a failure."""

    def __init__(
        self,
        messages: list[Message],
        tools: list[Tool],
        llm: LLMClient,
        agent: AgentConfig,
        *,
        protocol: Protocol,
        temperature: float,
        seed: int | None,
    ) -> None:
        self.tools = {t.name: t for t in tools}
        self.llm, self.agent, self.protocol = llm, agent, protocol
        self.temperature, self.seed = temperature, seed
        self.messages = agent_messages(messages, tools, protocol, agent.max_turns)
        self.turns: list[Turn] = []
        self.calls: list[LLMCall] = []
        self.tool_time_s = 0.0
        self.finish_reason = ""
        self.n_turns = 0
        self.started = time.monotonic()

    async def run(self) -> None:
        context = ToolContext(self.agent)
        try:
            for turn in range(self.agent.max_turns):
                last = turn == self.agent.max_turns - 1
                if await asyncio.wait_for(self._turn(turn, last, context), self.agent.turn_timeout_s):
                    return
        finally:
            await context.aclose()

    async def _turn(self, turn: int, last: bool, context: ToolContext) -> bool:
        """One model call and the tools it asked for; True when the rollout is finished."""
        if last and turn > 0:
            self.messages.append({"role": "user", "content": LAST_TURN_NOTE})
        tools = [t.spec() for t in self.tools.values()] if self.protocol == "tools" else None
        reply = await self.llm.turn(
            self.messages,
            stage="rollout",
            turn=turn,
            tools=tools,
            tool_choice="none" if tools and last else None,
            temperature=self.temperature,
            seed=self.seed,
            calls=self.calls,
        )
        self.n_turns += 1
        self.finish_reason = reply.finish_reason
        actions, said = self._actions(reply.text, reply.tool_calls, turn)
        self.turns.append(Turn(kind="assistant", content=said, turn=turn, truncated=reply.finish_reason == "length"))
        if last or not actions:
            return True
        self._remember_reply(said, actions)
        for action in actions:
            await self._run_action(action, turn, context)
        return False

    def _actions(self, text: str, tool_calls: list[ToolCall], turn: int) -> tuple[list[Action], str]:
        if self.protocol == "tools":
            if not tool_calls and self.agent.protocol == "auto" and tool_call_in_text(text, set(self.tools)):
                raise ToolsIgnored(text)
            return [_tool_calling_action(c) for c in tool_calls], text
        parsed = parse_text_action(text, self.tools, turn)
        return ([parsed[1]], parsed[0]) if parsed else ([], text)

    def _remember_reply(self, said: str, actions: list[Action]) -> None:
        if self.protocol == "text":
            self.messages.append({"role": "assistant", "content": said})
            return
        self.messages.append(
            {
                "role": "assistant",
                "content": said or None,
                "tool_calls": [
                    {"id": a.call_id, "type": "function", "function": {"name": a.name, "arguments": a.arguments_text}}
                    for a in actions
                ],
            }
        )

    async def _run_action(self, action: Action, turn: int, context: ToolContext) -> None:
        self.turns.append(
            Turn(
                kind="tool_call",
                content=action.arguments_text,
                tool_name=action.name,
                turn=turn,
                call_id=action.call_id,
            )
        )
        started = time.monotonic()
        output = await self._output(action, context)
        self.tool_time_s += time.monotonic() - started
        text = result_text(output)
        self.turns.append(
            Turn(
                kind="tool_result",
                content=output.text,
                tool_name=action.name,
                turn=turn,
                call_id=action.call_id,
                error=output.error,
                truncated=output.truncated,
            )
        )
        visible = clip(text, self.agent.tool_result_chars)  # head and tail, the cut marked
        if self.protocol == "tools":
            self.messages.append({"role": "tool", "tool_call_id": action.call_id, "content": visible})
        else:
            self.messages.append(
                {"role": "user", "content": TOOL_RESULT_TEMPLATE.format(name=action.name, text=visible)}
            )

    async def _output(self, action: Action, context: ToolContext) -> ToolOutput:
        tool = self.tools.get(action.name)
        if tool is None:
            return ToolOutput("", error=f"unknown tool {action.name!r}; the tools are: {', '.join(self.tools)}")
        if action.arguments is None:
            return ToolOutput("", error=f"{action.name}: {action.problem}")
        try:
            return await tool.run(action.arguments, context)
        except ToolFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - a tool's own bug or bad arguments: the model sees it, the rollout goes on
            return ToolOutput("", error=f"{action.name} failed: {type(exc).__name__}: {exc}")

    def rollout(self, base: dict[str, Any], error: str | None = None) -> Rollout:
        ok = [c for c in self.calls if c.ok]
        results = [t for t in self.turns if t.kind == "tool_result"]
        return Rollout(
            **base,
            turns=self.turns,
            tokens_in=sum(c.tokens_in for c in ok),
            tokens_out=sum(c.tokens_out for c in ok),
            latency_s=sum(c.latency_s for c in self.calls),
            error=error,
            finish_reason=self.finish_reason,
            n_turns=self.n_turns,
            tool_calls=len(results),
            tool_errors=sum(t.error is not None for t in results),
            tool_time_s=round(self.tool_time_s, 6),
        )


def _without_tool_calling(llm: LLMClient) -> Protocol:
    """Remember that the policy endpoint has no tool calling; the rollout starts over with the text protocol."""
    cfg = llm.configs["policy"]
    _NO_TOOL_CALLING.add((cfg.model, cfg.base_url))
    return "text"


async def agent_rollout(
    messages: list[Message],
    tools: list[Tool],
    llm: LLMClient,
    agent: AgentConfig,
    *,
    base: dict[str, Any],
    temperature: float,
    seed: int | None,
) -> AgentOutcome:
    """One agent rollout of ``messages`` (the domain's rollout prompt). Never raises for a failed model call,
    timeout or unavailable tool: those make a rollout with ``error`` set (its calls are returned either way)."""
    calls: list[LLMCall] = []
    protocol = resolve_protocol(llm, agent)
    while True:
        loop = AgentLoop(messages, tools, llm, agent, protocol=protocol, temperature=temperature, seed=seed)
        try:
            await asyncio.wait_for(loop.run(), agent.rollout_timeout_s)
        except ToolsIgnored:
            calls += loop.calls  # the reply that wrote its call as text stays recorded
            protocol = _without_tool_calling(llm)
            continue
        except LLMCallError as exc:
            calls += loop.calls
            if isinstance(exc.__cause__, ToolsRefused) and agent.protocol == "auto" and protocol == "tools":
                protocol = _without_tool_calling(llm)
                continue
            return AgentOutcome(loop.rollout(base, error=str(exc)), calls)
        except asyncio.TimeoutError:
            whole = time.monotonic() - loop.started >= agent.rollout_timeout_s
            limit = (
                f"rollout_timeout_s={agent.rollout_timeout_s:g}"
                if whole
                else f"turn_timeout_s={agent.turn_timeout_s:g}"
            )
            calls += loop.calls
            return AgentOutcome(
                loop.rollout(base, error=f"agent rollout timed out in turn {loop.n_turns} ({limit})"), calls
            )
        except ToolFailure as exc:
            calls += loop.calls
            return AgentOutcome(loop.rollout(base, error=str(exc)), calls)
        calls += loop.calls
        return AgentOutcome(loop.rollout(base), calls)
