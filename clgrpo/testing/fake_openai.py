"""A fake OpenAI-compatible HTTP server for tests and benchmarks (stdlib only).

The official ``openai`` SDK talks to it unchanged (``base_url=server.base_url``). A ``Responder`` produces the
choices: a content string each, or a ``Reply`` that may call tools (OpenAI tool calling: the server gives each call
an id and the choice ``finish_reason: "tool_calls"``; with ``supports_tools=False`` a request that lists ``tools``
is refused with HTTP 400, as by servers without tool calling). The server adds the chat.completion envelope, usage
counts, optional latency, a concurrency cap, fault injection and thread-safe request statistics.

Faults (``server.inject(Fault(...))``, the fault model of ``clgrpo.testing.faults`` that the fakes share) are the
replies a real proxy sees: HTTP errors ("status", e.g. 429 with Retry-After or 5xx), slow replies ("delay"),
connections closed cleanly ("drop") or reset ("reset"), and 200 replies that are broken ("malformed" JSON,
"no_choices", "empty" contents, "truncate"d at a few words). A fault is scoped to a stage with
``match=match_roles(...)`` and applied a number of ``times``, with a probability (``rate``, drawn from the server's
seeded RNG) or for a time window (``window_s``); ``Fault.mixed`` picks one of several kinds per affected request.
Example, a reproducible 20% mix on the policy stage::

    server = FakeOpenAIServer(responder, seed=1)
    server.inject(Fault.mixed(rate=0.2, match=match_roles("policy")))
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from clgrpo.testing.faults import DEFAULT_MIX, FAULT_KINDS, Fault, retry_after_header
from clgrpo.testing.loopback import LoopbackHandler, LoopbackServer

__all__ = [
    "DEFAULT_MIX",
    "POLICY_ROLE",
    "ChatRequest",
    "Reply",
    "Fault",
    "FakeOpenAIServer",
    "RequestLogEntry",
    "Responder",
    "ServerStats",
    "match_roles",
    "message_text",
    "role_of",
]

POLICY_ROLE = "policy"
_CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
_MODELS_PATHS = ("/v1/models", "/models")
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout",
    409: "conflict",
    429: "rate_limit_exceeded",
}


@dataclass(frozen=True)
class ChatRequest:
    """A parsed chat-completions request. ``messages`` carry string contents (content parts are joined)."""

    model: str
    messages: list[dict[str, Any]]
    n: int = 1
    temperature: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # OpenAI tool definitions, when the request lists tools
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Reply:
    """A choice that may call tools: ``tool_calls`` is a list of ``(name, arguments)`` (a dict or JSON text)."""

    content: str | None = None
    tool_calls: tuple[tuple[str, Any], ...] = ()


class Responder(Protocol):
    def __call__(self, request: ChatRequest) -> list[str | Reply]:
        """One choice per item (normally ``request.n`` of them): a content string or a ``Reply``."""
        ...


@dataclass(frozen=True)
class RequestLogEntry:
    role: str
    n: int  # choices requested
    status: int  # HTTP status sent; 0 when the connection was dropped
    started: float  # time.monotonic()
    ended: float
    choices: int = 0  # choices returned
    fault: str | None = None  # Fault.label of the fault served, if any
    retry_count: int | None = None  # the SDK's x-stainless-retry-count header, when sent


@dataclass
class ServerStats:
    """Request counts. ``requests`` counts every counted HTTP request: the chat requests plus the ``invalid``
    ones (400 for bodies that are not a chat request, 404 for unknown paths; ``GET /models`` is not counted).
    ``chat_requests`` counts only the parsed chat requests, faulted ones included (one per client attempt, so a
    test can compare it with a client's recorded attempts); ``requests == chat_requests + invalid``."""

    requests: int = 0
    invalid: int = 0  # malformed bodies (400) and unknown paths (404)
    chat_requests: int = 0  # parsed chat-completions requests, faulted ones included
    by_role: Counter = field(default_factory=Counter)
    choices_by_role: Counter = field(default_factory=Counter)
    faults_served: Counter = field(default_factory=Counter)
    in_flight: int = 0
    max_in_flight: int = 0
    log: list[RequestLogEntry] = field(default_factory=list)


def message_text(message: dict[str, Any]) -> str:
    """The text of a message whose content is a string or a list of content parts."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def role_of(request: ChatRequest) -> str:
    """The first line of the system message after "ROLE:", or "policy" when there is no ROLE line."""
    for message in request.messages:
        if message.get("role") in ("system", "developer"):
            first = message_text(message).split("\n", 1)[0]
            if first.startswith("ROLE:"):
                return first[len("ROLE:") :].strip()
            return POLICY_ROLE
    return POLICY_ROLE


def match_roles(*roles: str) -> Callable[[ChatRequest], bool]:
    """A ``Fault.match`` predicate: the request's ``role_of`` is one of ``roles``. The stages: "policy" (no ROLE
    line) and the learner prompts of ``domains/learner.py`` ("trajectory summarizer", "experience extractor",
    "library consolidator")."""
    if not roles:
        raise ValueError("match_roles needs at least one role")
    wanted = frozenset(roles)

    def match(request: ChatRequest) -> bool:
        return role_of(request) in wanted

    match.__name__ = match.__qualname__ = f"match_roles({', '.join(map(repr, roles))})"
    return match


def _words(text: str) -> int:
    return len(text.split())


class BadRequest(ValueError):
    pass


def parse_chat_request(body: bytes) -> ChatRequest:
    try:
        raw = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise BadRequest("request body must be a JSON object")
    messages = raw.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("'messages' must be a non-empty list of objects")
    if raw.get("stream"):
        raise BadRequest("streaming is not supported by the fake server")
    n = raw.get("n") or 1
    if not isinstance(n, int) or n < 1:
        raise BadRequest("'n' must be a positive integer")
    return ChatRequest(
        model=str(raw.get("model") or "fake-model"),
        messages=[{**m, "content": message_text(m)} for m in messages],
        n=n,
        temperature=raw.get("temperature"),
        max_tokens=raw.get("max_tokens", raw.get("max_completion_tokens")),
        seed=raw.get("seed"),
        response_format=raw.get("response_format"),
        tools=raw.get("tools") or None,
        raw=raw,
    )


def _cap(content: str, max_tokens: int | None) -> tuple[str, str]:
    """A reply longer than ``max_tokens`` words (this server's tokens) is cut there, as a real server cuts it,
    with ``finish_reason: "length"``."""
    if max_tokens is None or _words(content) <= max_tokens:
        return content, "stop"
    return " ".join(content.split()[:max_tokens]), "length"


def _choice(index: int, reply: str | Reply, max_tokens: int | None, cut_words: int | None) -> dict[str, Any]:
    if isinstance(reply, Reply) and reply.tool_calls:
        calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:12]}",
                "type": "function",
                "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
            for name, args in reply.tool_calls
        ]
        message = {"role": "assistant", "content": reply.content, "tool_calls": calls}
        return {"index": index, "message": message, "finish_reason": "tool_calls", "logprobs": None}
    content = (reply.content or "") if isinstance(reply, Reply) else reply
    content, finish = _cap(content, max_tokens)
    if cut_words is not None:
        content, finish = " ".join(content.split()[: max(1, cut_words)]), "length"
    return {
        "index": index,
        "message": {"role": "assistant", "content": content},
        "finish_reason": finish,
        "logprobs": None,
    }


def _choice_words(choice: dict[str, Any]) -> int:
    message = choice["message"]
    calls = message.get("tool_calls") or []
    return _words(message.get("content") or "") + sum(_words(c["function"]["arguments"]) for c in calls)


def completion_body(
    request: ChatRequest, contents: list[str | Reply], *, cut_words: int | None = None
) -> dict[str, Any]:
    """The chat.completion for ``contents``; ``cut_words`` cuts every text choice there with finish_reason
    "length"."""
    choices = [_choice(i, c, request.max_tokens, cut_words) for i, c in enumerate(contents)]
    prompt_tokens = sum(_words(m["content"]) for m in request.messages)
    completion_tokens = sum(_choice_words(c) for c in choices)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": kind if status != 400 else None, "param": None}}


class _Dropped(Exception):
    """Raised inside a handler to close the connection without answering."""

    def __init__(self, reset: bool = False) -> None:
        super().__init__("reset" if reset else "drop")
        self.reset = reset  # send RST instead of a clean FIN


@dataclass
class _Outcome:
    status: int
    body: dict[str, Any] | bytes  # bytes: sent as is (a "malformed" body)
    headers: dict[str, str] = field(default_factory=dict)
    choices: int = 0


class _Handler(LoopbackHandler):
    protocol_version = "HTTP/1.1"
    # headers and body are two writes: with Nagle on, a keep-alive client's delayed ACK adds ~40 ms per request
    disable_nagle_algorithm = True

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path in _MODELS_PATHS:
            owner = self.server.owner
            models = [
                {"id": m, "object": "model", "created": int(time.time()), "owned_by": "fake", **owner.model_info}
                for m in owner.models
            ]
            self.send_json(200, {"object": "list", "data": models})
        else:
            self.server.owner._count_invalid()
            self.send_json(404, error_body(404, f"unknown path {self.path}"))

    def do_POST(self) -> None:
        body = self.read_body()
        path = self.path.split("?", 1)[0].rstrip("/")
        if path not in _CHAT_PATHS:
            self.server.owner._count_invalid()
            self.send_json(404, error_body(404, f"unknown path {self.path}"))
            return
        try:
            request = parse_chat_request(body)
        except BadRequest as exc:
            self.server.owner._count_invalid()
            self.send_json(400, error_body(400, str(exc)))
            return
        retry_header = self.headers.get("x-stainless-retry-count")
        retry_count = int(retry_header) if retry_header and retry_header.isdigit() else None
        try:
            outcome = self.server.owner._handle(request, retry_count)
        except _Dropped as dropped:
            self.reset() if dropped.reset else self.drop()
            return
        self.send_json(outcome.status, outcome.body, outcome.headers)


class FakeOpenAIServer(LoopbackServer):
    """``with FakeOpenAIServer(responder) as srv: AsyncOpenAI(base_url=srv.base_url, api_key="x")``."""

    handler_class = _Handler
    thread_name = "fake-openai"
    fault_kinds = FAULT_KINDS

    def __init__(
        self,
        responder: Responder,
        *,
        supports_n: bool = True,
        max_n: int | None = None,
        supports_tools: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
        latency: Callable[[ChatRequest], float] | None = None,
        max_concurrency: int | None = None,
        models: tuple[str, ...] | None = None,
        seed: int = 0,
        model_info: dict[str, Any] | None = None,
        system_fingerprint: str | None = None,
    ) -> None:
        """``seed`` seeds the RNG behind ``Fault.rate`` draws and ``Fault.mixed`` picks: the same seed and the same
        sequence of requests give the same faults (with concurrent requests, the arrival order decides).
        ``model_info``: what each ``GET /models`` entry states of the weights besides its id (llama-server's
        ``{"meta": {"n_params": ..., "size": ...}}``, vLLM's ``{"root": ...}``): the model's identity.
        ``system_fingerprint``: sent with every completion, as OpenAI does (None: not sent); may be changed."""
        super().__init__(host=host, port=port, seed=seed)
        self.responder = responder
        self.supports_n = supports_n
        self.max_n = max_n  # more choices in one request are refused with llama-server's HTTP 400
        self.supports_tools = supports_tools
        self.latency = latency
        # what GET /models lists: given, else what the responder says it serves (its ``models``), else fake-model
        self.models = models or tuple(getattr(responder, "models", ("fake-model",)))
        self.model_info = dict(model_info or {})
        self.system_fingerprint = system_fingerprint
        self._semaphore = threading.BoundedSemaphore(max_concurrency) if max_concurrency else None
        self._stats = ServerStats()

    @property
    def base_url(self) -> str:
        return f"{self.origin}/v1"

    # faults and stats -----------------------------------------------------------------------------------
    @property
    def stats(self) -> ServerStats:
        return self._stats

    def reset_stats(self) -> None:
        with self._lock:
            in_flight = self._stats.in_flight
            # in place, so references held by callers see the reset
            self._stats.__init__(in_flight=in_flight, max_in_flight=in_flight)  # type: ignore[misc]

    # request handling -----------------------------------------------------------------------------------
    def _count_invalid(self) -> None:
        with self._lock:
            self._stats.requests += 1
            self._stats.invalid += 1

    def _take_fault(self, request: ChatRequest) -> Fault | None:
        """The fault to serve (a "mixed" one resolved to the option picked), counted in ``faults_served``."""
        served = self.take_fault(request)
        if served is not None:
            with self._lock:
                self._stats.faults_served[served.label] += 1
        return served

    def _enter(self, role: str) -> None:
        with self._lock:
            stats = self._stats
            stats.requests += 1
            stats.chat_requests += 1
            stats.by_role[role] += 1
            stats.in_flight += 1
            stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)

    def _exit(self, entry: RequestLogEntry) -> None:
        with self._lock:
            stats = self._stats
            stats.in_flight = max(0, stats.in_flight - 1)
            stats.choices_by_role[entry.role] += entry.choices
            stats.log.append(entry)

    def _handle(self, request: ChatRequest, retry_count: int | None) -> _Outcome:
        role = role_of(request)
        if self._semaphore is not None:
            self._semaphore.acquire()
        started = time.monotonic()
        self._enter(role)
        outcome: _Outcome | None = None
        fault: Fault | None = None
        try:
            fault = self._take_fault(request)
            outcome = self._answer(request, fault)
            return outcome
        finally:
            status = outcome.status if outcome else 0
            choices = outcome.choices if outcome else 0
            self._exit(
                RequestLogEntry(
                    role=role,
                    n=request.n,
                    status=status,
                    started=started,
                    ended=time.monotonic(),
                    choices=choices,
                    fault=fault.label if fault else None,
                    retry_count=retry_count,
                )
            )
            if self._semaphore is not None:
                self._semaphore.release()

    def _answer(self, request: ChatRequest, fault: Fault | None) -> _Outcome:
        kind = fault.kind if fault is not None else None
        if kind in ("drop", "reset"):
            raise _Dropped(reset=kind == "reset")
        if fault is not None and kind == "status":
            message = fault.message or f"injected fault: HTTP {fault.status}"
            return _Outcome(fault.status, error_body(fault.status, message), retry_after_header(fault))
        if fault is not None and kind == "delay":
            self.wait(fault.delay_s)
        if self.latency is not None:
            self.wait(max(0.0, self.latency(request)))
        if self.max_n is not None and request.n > self.max_n:
            message = f"Field 'n': Value must be between 1 <= value <= {self.max_n}, but got {request.n}"
            return _Outcome(400, error_body(400, message))
        n = request.n if self.supports_n else 1
        if kind == "malformed":  # a chat.completion cut in half: no longer JSON
            data = json.dumps(completion_body(request, [""] * n)).encode("utf-8")
            return _Outcome(200, data[: len(data) // 2])
        if kind == "no_choices":
            body = completion_body(request, [])
            del body["choices"]
            return _Outcome(200, body)
        if kind == "empty":
            return _Outcome(200, completion_body(request, [""] * n), choices=n)
        return self._complete(request, cut_words=fault.cut_words if fault is not None and kind == "truncate" else None)

    def _complete(self, request: ChatRequest, cut_words: int | None = None) -> _Outcome:
        asked = request if self.supports_n else replace(request, n=1)
        if request.tools and not self.supports_tools:
            return _Outcome(400, error_body(400, "this server does not support tools (no tool calling)"))
        try:
            contents = [c if isinstance(c, Reply) else str(c) for c in self.responder(asked)]
        except Exception as exc:  # noqa: BLE001 - a responder bug becomes a visible 500, not a hung client
            return _Outcome(500, error_body(500, f"responder failed: {type(exc).__name__}: {exc}"))
        if not self.supports_n:
            contents = contents[:1]
        body = completion_body(request, contents, cut_words=cut_words)
        if self.system_fingerprint is not None:
            body["system_fingerprint"] = self.system_fingerprint
        return _Outcome(200, body, choices=len(contents))
