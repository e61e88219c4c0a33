"""The Domain protocol: what a domain plug-in supplies to the pipeline (found by name: ``domains/registry.py``)."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

from clgrpo.inputs.dataset import LoadReport
from clgrpo.prompts.rollout import ShownExample
from clgrpo.sandbox.verify_child import VerifyResult
from domains.learner import LearnerPrompts
from schemas.config import AgentConfig, DatasetConfig
from schemas.records import Problem

Message = dict[str, Any]
R = TypeVar("R")


@dataclass(frozen=True)
class ToolOutput:
    """What a tool call returns to the model: its output text, and for a failed call one line saying why
    (the model sees it and the rollout goes on)."""

    text: str
    error: str | None = None
    truncated: bool = False  # the output was cut (the tool's own cap)


class ToolFailure(RuntimeError):
    """Raised by a tool when it cannot work at all (its service or sandbox is unavailable): the rollout fails
    (stored with this cause, counted against the rollout tolerance, redone by a retry), since the model's
    attempt was not what went wrong. Anything else a tool raises becomes a tool error the model sees."""


class ToolContext:
    """What one agent rollout's tool calls share: the run's agent settings and per-rollout resources (a Python
    interpreter, a browser session), created on first use and closed when the rollout ends."""

    def __init__(self, agent: AgentConfig) -> None:
        self.agent = agent
        self._stack = contextlib.AsyncExitStack()
        self._resources: dict[str, Any] = {}

    async def resource(self, key: str, open_: Callable[[], contextlib.AbstractAsyncContextManager[R]]) -> R:
        """The rollout's resource ``key``, entered from ``open_()`` on first use."""
        if key not in self._resources:
            self._resources[key] = await self._stack.enter_async_context(open_())
        return self._resources[key]

    async def aclose(self) -> None:
        self._resources.clear()
        await self._stack.aclose()


@dataclass(frozen=True)
class Tool:
    """A tool agent rollouts may call. ``parameters``: the JSON schema of its arguments (an object);
    ``run(arguments, context)``: the implementation. ``text_argument``: for models without tool calling, a
    fenced block named after the tool (```python ... ```) passes its content as this argument."""

    name: str
    description: str
    parameters: dict[str, Any]
    run: Callable[[dict[str, Any], ToolContext], Awaitable[ToolOutput]]
    text_argument: str | None = None
    # checked before a run starts: returns one line on what the tool will use, raises ToolFailure if it cannot work
    check: Callable[[AgentConfig], str] | None = None

    def spec(self) -> dict[str, Any]:
        """The OpenAI tool definition."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@runtime_checkable
class Domain(Protocol):
    """A domain. One with settings of its own also has ``settings_model`` (its ``schemas.config.DomainSettings``
    class, on the factory) and ``settings`` (the run's, set by ``domains.registry.domain_for``)."""

    name: str
    learner_prompts: LearnerPrompts  # wording of the summarize / extract / consolidate prompts

    def load_dataset(self, cfg: DatasetConfig) -> tuple[list[Problem], LoadReport]:
        """Load, validate, de-duplicate, shuffle and truncate the problems."""
        ...

    def verify(self, output: str, answer: str) -> VerifyResult:
        """Grade one output against the ground truth; never raises."""
        ...

    def verify_batch(self, items: Sequence[tuple[str, str]]) -> list[VerifyResult]:
        """Grade many (output, answer) pairs; never raises."""
        ...

    def rollout_messages(
        self, problem: Problem, library_text: str, examples: Sequence[ShownExample] = (), form: str = "turns"
    ) -> list[Message]:
        """Chat messages for one rollout. The library goes before the problem (shared prefix); worked examples
        (``examples``, only passed when the library shows some) as earlier turns or a block in the library
        (``form``), as ``clgrpo.prompts.rollout.rollout_conversation`` lays them out. A domain written before
        examples existed may leave both out: it then gets libraries without examples only."""
        ...

    def tools(self) -> list[Tool]:
        """The tools agent rollouts of this domain may call (``rollout.mode: agent``); may be empty."""
        ...

    def warm(self) -> None:
        """Start whatever verification needs, in the background; returns at once. Optional: callers use
        ``getattr(domain, "warm", None)``, so a domain without it still works."""
        ...
