"""The one LLM client: every model call of every stage goes through here.

It owns the global concurrency limit, per-call timeouts, retries, G samples per problem (``n=G`` where the
endpoint supports it, else G calls), structured output with one repair re-ask, and an ``LLMCall`` record for
every request sent (tokens, latency, cost, and for a failed attempt its cause).

Retries: transient errors (5xx, timeouts, connection resets, malformed or empty replies) are retried with
exponential backoff and jitter up to ``max_retries`` times. Rate limits (429) are retried by time, not by count:
for up to ``max_rate_limit_wait_s`` from a call's first 429, honouring ``Retry-After``, with every caller
paused until the window ends. Each record is also appended to the active work journal (``clgrpo.storage.journal``) the
moment it exists, so calls of a stage that fails or is killed are still accounted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from clgrpo.llm.backends import (
    Backend,
    Generation,
    GenRequest,
    Message,
    PermanentLLMError,
    SchemaRefused,
    ToolCall,
    TransientLLMError,
    schema_refused,
)
from clgrpo.llm.errors import CountRefused
from clgrpo.llm.factory import make_backend
from clgrpo.llm.structured import StructuredOutputError, parse_operations
from clgrpo.models.retry import Backoff, RetryBudget
from clgrpo.storage import journal
from schemas.config import ModelConfig, RunConfig
from schemas.records import LLMCall, Operation, utcnow

Role = Literal["policy", "learner"]
RepairFn = Callable[[list[Message], str, str], list[Message]]
PromptFn = Callable[[bool], list[Message]]  # constrained -> the messages (an unconstrained reply needs the example)


class LLMCallError(RuntimeError):
    """A call that failed after its retries; ``calls`` holds the records of what was attempted."""

    def __init__(self, message: str, calls: list[LLMCall]) -> None:
        super().__init__(message)
        self.calls = calls


@dataclass
class Completion:
    """One policy completion: its text and finish reason, or the error of the call that failed to produce it."""

    index: int
    text: str = ""
    finish_reason: str = ""
    error: str | None = None


@dataclass
class Sampled:
    samples: list[Completion]
    calls: list[LLMCall]

    @property
    def texts(self) -> list[str]:
        return [s.text for s in self.samples]

    @property
    def failed(self) -> list[Completion]:
        return [s for s in self.samples if s.error is not None]


@dataclass
class Completed:
    text: str
    calls: list[LLMCall]  # every request sent for it (retried attempts first)
    finish_reason: str = ""  # "length": the reply was cut at max_tokens

    @property
    def call(self) -> LLMCall:
        """The attempt that produced the reply."""
        return self.calls[-1]


@dataclass
class TurnReply:
    """One agent turn: the model's text and the tools it called (OpenAI tool calling; empty otherwise)."""

    text: str
    tool_calls: list[ToolCall]
    calls: list[LLMCall]
    finish_reason: str = ""


@dataclass
class OperationsReply:
    operations: list[Operation]
    raw_text: str
    parse_error: str | None
    calls: list[LLMCall] = field(default_factory=list)


@dataclass
class _LoopState:
    """Per event loop: asyncio primitives and HTTP clients cannot cross loops."""

    semaphore: asyncio.Semaphore
    backends: dict[Role, Backend] = field(default_factory=dict)
    pause_until: float = 0.0


class LLMClient:
    def __init__(
        self,
        policy: ModelConfig,
        learner: ModelConfig | None = None,
        *,
        concurrency: int = 32,
        backend_factory: Callable[[ModelConfig], Backend] = make_backend,
        rng: random.Random | None = None,
    ) -> None:
        self.configs: dict[Role, ModelConfig] = {"policy": policy, "learner": learner or policy}
        self.concurrency = concurrency
        self._factory = backend_factory
        self._rng = rng or random.Random()
        self._states: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = weakref.WeakKeyDictionary()
        # per model, the most choices asked for in one request: lowered when an endpoint ignores or refuses n
        self._most_n: dict[str, int] = {}

    @classmethod
    def from_run_config(cls, cfg: RunConfig) -> "LLMClient":
        return cls(cfg.policy, learner_config(cfg), concurrency=cfg.concurrency)

    # --- public calls ---------------------------------------------------------------------------------
    async def sample(
        self,
        messages: list[Message],
        n: int,
        *,
        stage: str,
        temperature: float | None = None,
        seed: int | None = None,
        indices: list[int] | None = None,
    ) -> Sampled:
        """Policy samples ``indices`` (default: 0..n-1) of one prompt, in index order. A failed call fails only
        the samples it was for: the others are kept (sample i sent on its own uses seed + i)."""
        cfg = self.configs["policy"]
        request = _request(cfg, messages, n=n, temperature=temperature, seed=seed if seed is not None else cfg.seed)
        wanted = list(range(n)) if indices is None else sorted(indices)
        calls: list[LLMCall] = []
        samples: dict[int, Completion] = {}
        if cfg.supports_n and 1 < n <= self._most_n.get(cfg.model, n) and wanted == list(range(n)):
            try:
                gen = await self._call("policy", request, stage, calls)
            except LLMCallError as exc:
                if not isinstance(exc.__cause__, CountRefused):
                    return Sampled([Completion(i, error=str(exc)) for i in wanted], calls)
                self._most_n[cfg.model] = n - 1  # refused (recorded): one per request, now and for n or more
            else:
                for i, text in enumerate(gen.texts[:n]):
                    samples[i] = Completion(i, text, _at(gen.finish_reasons, i))
                if len(samples) < n:  # the endpoint ignored n: top up, and send single requests from now on
                    self._most_n[cfg.model] = 1
        rest = [i for i in wanted if i not in samples]
        outcomes = await asyncio.gather(
            *[self._call("policy", _single(request, i), stage, calls) for i in rest], return_exceptions=True
        )
        for i, outcome in zip(rest, outcomes):
            if isinstance(outcome, LLMCallError):
                samples[i] = Completion(i, error=str(outcome))
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                samples[i] = Completion(i, outcome.texts[0] if outcome.texts else "", _at(outcome.finish_reasons, 0))
        return Sampled([samples[i] for i in wanted], calls)

    async def complete(
        self,
        messages: list[Message] | PromptFn,
        *,
        stage: str,
        role: Role = "learner",
        json_schema: dict | None = None,
        schema_name: str = "reply",
        temperature: float | None = None,
        redraw: int = 0,
    ) -> Completed:
        """One reply; ``redraw`` k > 0 asks for the k-th other draw (a seeded config uses seed + k). ``messages``
        may be a function of whether the reply is constrained to ``json_schema``: when the endpoint refuses the
        schema, the call is asked again with the unconstrained prompt (and every later one is written so)."""
        cfg = self.configs[role]
        seed = None if cfg.seed is None else cfg.seed + redraw
        constrained = json_schema is not None and self.constrains_json(role)
        prompt = messages(constrained) if callable(messages) else messages
        request = _request(
            cfg,
            prompt,
            temperature=temperature,
            seed=seed,
            schema_name=schema_name,
            json_schema=json_schema if constrained else None,
        )
        calls: list[LLMCall] = []
        try:
            gen = await self._call(role, request, stage, calls, refusal_raises=callable(messages))
        except SchemaRefused:  # the prompt was written for a constrained reply: ask with the other one
            request = dataclasses.replace(request, messages=messages(False), json_schema=None)  # type: ignore[operator]
            gen = await self._call(role, request, stage, calls)
        return Completed(
            text=gen.texts[0] if gen.texts else "",
            calls=calls,
            finish_reason=gen.finish_reasons[0] if gen.finish_reasons else "",
        )

    async def turn(
        self,
        messages: list[Message],
        *,
        stage: str,
        turn: int,
        tools: list[dict] | None = None,
        tool_choice: str | None = None,
        temperature: float | None = None,
        seed: int | None = None,
        calls: list[LLMCall] | None = None,
    ) -> TurnReply:
        """One policy turn of an agent rollout (its ``LLMCall`` records carry ``turn``). Raises ``LLMCallError``
        after the retries; its cause is ``ToolsRefused`` when the endpoint has no tool calling. ``calls``: the
        caller's list, which gets every attempt as it is recorded (also one cut short by a timeout)."""
        cfg = self.configs["policy"]
        request = _request(
            cfg,
            messages,
            temperature=temperature,
            seed=seed if seed is not None else cfg.seed,
            tools=tools or None,
            tool_choice=tool_choice,
        )
        calls = [] if calls is None else calls
        gen = await self._call("policy", request, stage, calls, turn=turn)
        return TurnReply(
            text=gen.texts[0] if gen.texts else "",
            tool_calls=gen.tool_calls[0] if gen.tool_calls else [],
            calls=calls,
            finish_reason=_at(gen.finish_reasons, 0),
        )

    async def complete_operations(
        self, messages: list[Message] | PromptFn, *, stage: str, json_schema: dict, repair: Callable[..., list[Message]]
    ) -> OperationsReply:
        """Ask for operations as JSON; one second ask on an unusable reply: a repair re-ask that shows the reply
        and its error, or, for a reply cut off at max_tokens (usually a loop, which a model shown its own loop
        continues), a fresh draw of the same prompt. What still fails comes back with its raw text and
        ``parse_error`` set (never raised, never dropped). ``messages`` as in ``complete``; ``repair(messages,
        reply, error, show_example=...)`` is told whether replies are still constrained."""
        first = await self.complete(messages, stage=stage, json_schema=json_schema, schema_name="operations")
        try:
            return OperationsReply(parse_operations(first.text), first.text, None, first.calls)
        except StructuredOutputError as exc:
            error = self._why_unusable(exc, first)
        asked = messages(self.constrains_json("learner")) if callable(messages) else messages
        try:
            if first.finish_reason == "length":
                second = await self.complete(
                    messages, stage=stage, json_schema=json_schema, schema_name="operations", redraw=1
                )
            else:
                second = await self.complete(
                    repair(asked, first.text, error, show_example=not self.constrains_json("learner")),
                    stage=stage,
                    json_schema=json_schema,
                    schema_name="operations",
                )
        except LLMCallError as exc:
            raise LLMCallError(str(exc), [*first.calls, *exc.calls]) from exc
        calls = [*first.calls, *second.calls]
        try:
            return OperationsReply(parse_operations(second.text), second.text, None, calls)
        except StructuredOutputError as exc:
            raw = json.dumps({"first_reply": first.text, "second_reply": second.text}, ensure_ascii=False)
            again = "a second draw" if first.finish_reason == "length" else "repair"
            return OperationsReply(
                [], raw, f"unparseable after {again}: {self._why_unusable(exc, second)} (first reply: {error})", calls
            )

    def _why_unusable(self, exc: StructuredOutputError, reply: Completed) -> str:
        if reply.finish_reason == "length":
            return f"{exc}: the reply was cut off at max_tokens={self.configs['learner'].max_tokens}"
        return str(exc)

    def constrains_json(self, role: Role) -> bool:
        """Whether ``role``'s replies are constrained to the JSON schema sent with them (``json_schema: true``:
        the endpoint or local engine enforces it, and it has not refused one in this process), so prompts need
        not show an example reply."""
        cfg = self.configs[role]
        return cfg.json_schema and not schema_refused(cfg)

    async def aclose(self) -> None:
        for state in list(self._states.values()):
            for backend in state.backends.values():
                await backend.aclose()
            state.backends.clear()

    # --- the retry loop -------------------------------------------------------------------------------
    def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        if loop not in self._states:
            self._states[loop] = _LoopState(semaphore=asyncio.Semaphore(self.concurrency))
        return self._states[loop]

    def _backend(self, state: _LoopState, role: Role) -> Backend:
        if role not in state.backends:
            # the same engine or endpoint (max_tokens is per request: a capped learner shares the policy's)
            learner_is_policy = self.configs["learner"].model_copy(update={"max_tokens": 1}) == self.configs[
                "policy"
            ].model_copy(update={"max_tokens": 1})
            if role == "learner" and learner_is_policy and "policy" in state.backends:
                state.backends[role] = state.backends["policy"]
            else:
                state.backends[role] = self._factory(self.configs[role])
        return state.backends[role]

    async def _call(
        self,
        role: Role,
        request: GenRequest,
        stage: str,
        calls: list[LLMCall],
        *,
        turn: int | None = None,
        refusal_raises: bool = False,
    ) -> Generation:
        """One call: attempts until success, a permanent error, ``max_retries`` transient errors, or
        ``max_rate_limit_wait_s`` of rate limiting. Every attempt is recorded (``calls`` and the journal).
        ``refusal_raises``: a refused JSON schema raises ``SchemaRefused`` (recorded) instead of being retried
        without it, so the caller can rewrite its prompt."""
        state, one = self._state(), _OneCall(stage, role, self.configs[role], calls, turn)
        while True:
            await self._respect_pause(state)
            attempt = _Attempt()
            try:
                gen = await self._attempt(state, role, request, attempt)
            except asyncio.CancelledError:  # the caller gave up (a timeout around this call) while it was sent
                if attempt.sent:
                    one.record(attempt, error="cancelled: the caller's time limit ended this request")
                raise
            except PermanentLLMError as exc:
                one.record(attempt, error=str(exc))
                raise LLMCallError(f"{stage}/{role}: {exc}", calls) from exc
            except (TransientLLMError, asyncio.TimeoutError) as exc:
                await self._after_transient(state, one, attempt, exc, refusal_raises)
            else:
                one.record(attempt, gen)
                return gen

    async def _attempt(self, state: _LoopState, role: Role, request: GenRequest, attempt: _Attempt) -> Generation:
        """One request within the concurrency limit and the model's timeout (its latency from when it is sent)."""
        async with state.semaphore:
            attempt.sent_now()
            return await asyncio.wait_for(self._backend(state, role).generate(request), self.configs[role].timeout_s)

    async def _after_transient(
        self, state: _LoopState, one: _OneCall, attempt: _Attempt, exc: BaseException, refusal_raises: bool
    ) -> None:
        """Record a transient failure; then raise (no attempt left, or a refused schema the caller rewrites its
        prompt for) or wait for the next attempt. A rate limit pauses every caller for the window."""
        limited = isinstance(exc, TransientLLMError) and exc.rate_limited
        counted = getattr(exc, "counted", True)
        reason = str(exc) or f"timeout after {one.cfg.timeout_s:g}s"
        spent = one.budget.spent(limited=limited, counted=counted, now=time.monotonic())
        refused = refusal_raises and isinstance(exc, SchemaRefused)
        one.record(attempt, error=reason, rate_limited=limited, final=spent is not None or refused)
        if refused:
            raise exc
        if spent is not None:
            raise LLMCallError(f"{one.stage}/{one.role}: {spent}: {reason}", one.calls) from exc
        retry_after = getattr(exc, "retry_after", None)
        delay = one.budget.next_delay(limited=limited, counted=counted, retry_after=retry_after, rng=self._rng)
        if limited:  # every caller waits out the window
            state.pause_until = max(state.pause_until, time.monotonic() + delay)
        await asyncio.sleep(delay)

    @staticmethod
    async def _respect_pause(state: _LoopState) -> None:
        while (wait := state.pause_until - time.monotonic()) > 0:  # the window may grow while we sleep
            await asyncio.sleep(wait)


@dataclass
class _Attempt:
    """When an attempt started (wall clock), how long it waited for its turn and when it was sent (monotonic: its
    latency excludes the wait; it ended at ``started + waited_s + latency``)."""

    started: datetime = field(default_factory=utcnow)
    t0: float = field(default_factory=time.monotonic)
    waited_s: float = 0.0
    sent: bool = False

    def sent_now(self) -> None:
        now = time.monotonic()
        self.t0, self.waited_s, self.sent = now, now - self.t0, True


@dataclass
class _OneCall:
    """One logical call: its id, its retry budget, and where each attempt's ``LLMCall`` goes (``calls`` and the
    active journal, the moment it exists)."""

    stage: str
    role: Role
    cfg: ModelConfig
    calls: list[LLMCall]
    turn: int | None
    call_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    budget: RetryBudget = field(init=False)

    def __post_init__(self) -> None:
        backoff = Backoff(self.cfg.retry_base_delay_s, self.cfg.retry_max_delay_s)
        self.budget = RetryBudget(self.cfg.max_retries, self.cfg.max_rate_limit_wait_s, backoff)

    def record(
        self,
        attempt: _Attempt,
        gen: Generation | None = None,
        *,
        error: str | None = None,
        rate_limited: bool = False,
        final: bool = True,
    ) -> None:
        call = self._call_record(attempt, gen, error, rate_limited, final)
        self.calls.append(call)
        sink = journal.active()
        if sink is not None:
            sink.add_call(call)

    def _call_record(
        self, attempt: _Attempt, gen: Generation | None, error: str | None, rate_limited: bool, final: bool
    ) -> LLMCall:
        cfg = self.cfg
        tokens_in, tokens_out = (gen.tokens_in, gen.tokens_out) if gen else (0, 0)
        return LLMCall(
            stage=self.stage,
            role=self.role,
            model=cfg.model,
            tokens_in=tokens_in,
            tokens_out=tokens_out,
            latency_s=time.monotonic() - attempt.t0,
            waited_s=attempt.waited_s,
            retries=self.budget.attempt,
            cost_usd=(tokens_in * cfg.price.input_per_mtok + tokens_out * cfg.price.output_per_mtok) / 1e6,
            ok=gen is not None,
            error=error,
            started_at=attempt.started,
            call_id=self.call_id,
            rate_limited=rate_limited,
            final=final,
            finish_reason=_at(gen.finish_reasons, 0) if gen else "",
            turn=self.turn,
            reply=_at(gen.texts, 0) if gen and self.role == "learner" else None,
            system_fingerprint=gen.system_fingerprint if gen else None,
        )


def _request(
    cfg: ModelConfig,
    messages: list[Message],
    *,
    n: int = 1,
    temperature: float | None,
    seed: int | None,
    **extra: Any,
) -> GenRequest:
    """A request with the model's sampling settings (``temperature`` None: the model's own)."""
    return GenRequest(
        messages=messages,
        n=n,
        temperature=cfg.temperature if temperature is None else temperature,
        top_p=cfg.top_p,
        max_tokens=cfg.max_tokens,
        seed=seed,
        repetition_penalty=cfg.repetition_penalty,
        **extra,
    )


def _at(values: list[str], index: int) -> str:
    return values[index] if index < len(values) else ""


def _single(request: GenRequest, index: int) -> GenRequest:
    seed = None if request.seed is None else request.seed + index
    return dataclasses.replace(request, n=1, seed=seed)


def learner_config(cfg: RunConfig) -> ModelConfig:
    """The learner's model settings, its max_tokens capped by ``learning.max_learner_tokens`` (learner replies
    are short: a learner that rambles costs, and learns, nothing more)."""
    learner = cfg.learner_model
    cap = cfg.learning.max_learner_tokens
    return learner if learner.max_tokens <= cap else learner.model_copy(update={"max_tokens": cap})


_SHARED: dict[str, LLMClient] = {}


def shared_client(cfg: RunConfig) -> LLMClient:
    """One client per process and model setup, so the concurrency limit holds across all stages."""
    key = json.dumps([cfg.policy.model_dump(mode="json"), learner_config(cfg).model_dump(mode="json"), cfg.concurrency])
    if key not in _SHARED:
        _SHARED[key] = LLMClient.from_run_config(cfg)
    return _SHARED[key]
