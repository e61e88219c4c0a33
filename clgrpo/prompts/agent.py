"""Agent rollouts' wording: the tool instructions added to the domain's system message (for OpenAI tool calling,
or for the text protocol: the tools' docs and the action forms), the last turn's note, and how a tool result
comes back under the text protocol (``tasks/agent.py`` runs the loop)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal, Protocol

TOOLS_INSTRUCTIONS = """
You can use tools while you work: {tool_list}.
Call a tool whenever computing or checking something is more reliable than doing it by hand; you get its result
before you continue. You have at most {max_turns} replies in all. When you are done, reply without calling a
tool and give your final answer in the required format."""

TEXT_INSTRUCTIONS = """
You can use tools while you work:
{tool_docs}
To call a tool, end your reply with exactly one action and stop writing; you get its result in a
<tool_result> block before you continue. {action_forms}
You have at most {max_turns} replies in all. When you are done, reply without an action and give your final
answer in the required format."""

FENCED_FORM = "For {name}, write the {argument} in a fenced block:\n```{name}\n...\n```"

TAG_FORM = 'Any tool: <tool name="NAME">{{"argument": "value"}}</tool> with its arguments as a JSON object.'

LAST_TURN_NOTE = (
    "This is your last reply: tools can no longer be used. Give your final answer now, in the required format."
)

TOOL_RESULT_TEMPLATE = '<tool_result name="{name}">\n{text}\n</tool_result>'


class ToolDoc(Protocol):
    """What the instructions say of a tool (``domains.base.Tool`` has it)."""

    @property
    def name(self) -> str: ...
    @property
    def description(self) -> str: ...
    @property
    def parameters(self) -> dict[str, Any]: ...
    @property
    def text_argument(self) -> str | None: ...


def agent_messages(
    messages: list[dict[str, Any]], tools: Sequence[ToolDoc], protocol: Literal["tools", "text"], max_turns: int
) -> list[dict[str, Any]]:
    """The domain's rollout messages with the tool instructions added to its system message (problem-
    independent, so the shared prompt prefix stays shared)."""
    if protocol == "tools":
        extra = TOOLS_INSTRUCTIONS.format(tool_list=", ".join(t.name for t in tools), max_turns=max_turns)
    else:
        docs = "\n".join(
            f"- {t.name}: {t.description} Arguments (JSON schema): {json.dumps(t.parameters)}" for t in tools
        )
        forms = [FENCED_FORM.format(name=t.name, argument=t.text_argument) for t in tools if t.text_argument]
        extra = TEXT_INSTRUCTIONS.format(
            tool_docs=docs, action_forms="\n".join([*forms, TAG_FORM]), max_turns=max_turns
        )
    out = [dict(m) for m in messages]
    system = next((m for m in out if m.get("role") == "system"), None)
    if system is None:
        out.insert(0, {"role": "system", "content": extra.strip()})
    else:
        system["content"] = f"{system['content']}\n{extra}"
    return out
