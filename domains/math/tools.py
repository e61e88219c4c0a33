"""The math domain's tool: a sandboxed Python interpreter, one per agent rollout (``clgrpo.sandbox.pool``)."""

from __future__ import annotations

from typing import Any

from clgrpo.prompts.math_rollout import PYTHON_DESCRIPTION
from domains.base import Tool, ToolContext, ToolFailure, ToolOutput
from schemas.config import AgentConfig


async def run_python(arguments: dict[str, Any], context: ToolContext) -> ToolOutput:
    from clgrpo.sandbox.isolation import SandboxUnavailable
    from clgrpo.sandbox.pool import sandbox_for

    code = arguments.get("code")
    if not isinstance(code, str) or not code.strip():
        return ToolOutput("", error="missing argument 'code' (the Python source to run)")
    try:
        session = await context.resource("python", sandbox_for(context.agent.sandbox).session)
        result = await session.run(code)
    except SandboxUnavailable as exc:
        raise ToolFailure(f"python tool unavailable: {exc}") from exc
    text = result.output
    if result.truncated:
        text += f"\n[output truncated: {result.output_total_chars} characters, the first {len(result.output)} shown]"
    return ToolOutput(text, error=result.error, truncated=result.truncated)


def check_python(agent: AgentConfig) -> str:
    """The sandbox works on this machine (its kernel features), or one line on what is missing."""
    from clgrpo.sandbox.isolation import SandboxUnavailable, check_isolation

    try:
        return f"python tool: {check_isolation()}"
    except SandboxUnavailable as exc:
        raise ToolFailure(f"python tool unavailable: {exc}") from exc


PYTHON_TOOL = Tool(
    name="python",
    description=PYTHON_DESCRIPTION,
    parameters={
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python source to run"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    run=run_python,
    text_argument="code",
    check=check_python,
)
