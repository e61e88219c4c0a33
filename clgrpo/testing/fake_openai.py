"""A fake OpenAI-compatible HTTP server for tests and benchmarks (stdlib only).

The official ``openai`` SDK talks to it unchanged (``base_url=server.base_url``). A ``Responder`` produces the
choices: a content string each, or a ``Reply`` that may call tools (OpenAI tool calling: the server gives each
call an id and the choice ``finish_reason: "tool_calls"``; with ``supports_tools=False`` a request that lists
``tools`` is refused with HTTP 400, as by servers without tool calling). The server adds the chat.completion envelope, usage counts, optional latency, a concurrency
cap, fault injection and thread-safe request statistics.

Faults (``server.inject(Fault(...))``) are the replies a real proxy sees: HTTP errors ("status", e.g. 429 with
Retry-After or 5xx), slow replies ("delay"), connections closed cleanly ("drop") or reset ("reset"), and 200
replies that are broken ("malformed" JSON, "no_choices", "empty" contents, "truncate"d at a few words). A fault
is scoped to a stage with ``match=match_roles(...)`` and applied a number of ``times``, with a probability
(``rate``, drawn from the server's seeded RNG) or for a time window (``window_s``); ``Fault.mixed`` picks one of
several kinds per affected request. Example, a reproducible 20% mix on the policy stage::

    server = FakeOpenAIServer(responder, seed=1)
    server.inject(Fault.mixed(rate=0.2, match=match_roles("policy")))
"""

from __future__ import annotations

import json
import random
import socket
import struct
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal, Protocol, get_args

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


FaultKind = Literal["status", "delay", "drop", "reset", "malformed", "no_choices", "empty", "truncate", "mixed"]
_KINDS = frozenset(get_args(FaultKind))


@dataclass
class Fault:
    """A scripted failure. ``kind``:

    - "status": answers HTTP ``status`` with an OpenAI-style error body (and ``Retry-After: retry_after`` if
      set), e.g. 429 or 5xx;
    - "delay": sleeps ``delay_s``, then answers normally (a client timeout below ``delay_s`` fires);
    - "drop": closes the connection cleanly (FIN) without any response;
    - "reset": resets the connection (RST: ``SO_LINGER (1, 0)``, then close) without any response;
    - "malformed": HTTP 200, ``application/json``, a body that is not valid JSON (a chat.completion cut in half);
    - "no_choices": HTTP 200, a valid chat.completion object (with ``usage``) that has no ``choices`` key;
    - "empty": HTTP 200, a normal completion whose every choice has content "" (finish_reason "stop");
    - "truncate": HTTP 200, the responder's normal reply with every choice cut to at most ``max(1, cut_words)``
      words and finish_reason "length";
    - "mixed": one of ``options`` (other faults), picked uniformly per affected request on the server's seeded
      RNG; build it with ``Fault.mixed``.

    "status", "drop" and "reset" answer at once; the 200 kinds and "delay" wait the server's ``latency`` like a
    normal reply. Only "delay" and "truncate" call the responder.

    When the fault applies, for a request it ``match``es (None: every request; ``match_roles`` scopes it to
    stages): without ``rate`` and ``window_s``, to the next ``times`` matching requests, then it is removed. With
    ``rate``, to each matching request with that probability (one draw per matching request on the server's
    ``random.Random(seed)``); ``times`` is then ignored. With ``window_s``, to the matching requests that arrive
    within ``window_s`` seconds of the first matching request (the window starts at that request, not at inject
    time, so a slow start does not eat the window); after it the fault is removed. ``rate`` and ``window_s``
    combine (a 20% rate for 2 s). Faults are tried in inject order and the first that applies is served; a rate
    fault whose draw misses lets the later faults be tried.
    """

    kind: FaultKind = "status"
    match: Callable[[ChatRequest], bool] | None = None  # None: any request
    times: int = 1  # matching requests affected before the fault is consumed (without rate and window_s)
    status: int = 500
    retry_after: float | None = None  # seconds, sent as the Retry-After header
    delay_s: float = 0.0
    cut_words: int = 3  # "truncate": words kept per choice (at least 1)
    rate: float | None = None  # probability per matching request; never consumed
    window_s: float | None = None  # active for this long after the first matching request, then removed
    options: tuple["Fault", ...] = ()  # "mixed": the faults to pick from
    _window_started: float | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; expected one of {sorted(_KINDS)}")
        if self.rate is not None and not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {self.rate}")
        if self.window_s is not None and self.window_s <= 0:
            raise ValueError(f"window_s must be positive, got {self.window_s}")
        if self.kind == "mixed":
            if not self.options:
                raise ValueError("a mixed fault needs options")
            if any(o.kind == "mixed" for o in self.options):
                raise ValueError("mixed faults cannot be nested")

    @classmethod
    def mixed(
        cls,
        rate: float | None = None,
        kinds: tuple["str | Fault", ...] | None = None,
        *,
        match: Callable[[ChatRequest], bool] | None = None,
        times: int = 1,
        window_s: float | None = None,
    ) -> "Fault":
        """A fault that serves one of ``kinds`` (default ``DEFAULT_MIX``), picked uniformly per affected request
        on the server's seeded RNG. A kind is a ``Fault`` (its own ``match``/``times``/``rate``/``window_s`` are
        ignored: the mixed fault decides when to apply) or a string: a kind name ("malformed", "reset", ...) or
        "status:<code>" (no Retry-After; pass ``Fault(kind="status", status=429, retry_after=1)`` for one).
        ``faults_served`` and the request log record the label of the kind served, never "mixed"."""
        options = tuple(_as_fault(k) for k in (DEFAULT_MIX if kinds is None else kinds))
        return cls(kind="mixed", match=match, times=times, rate=rate, window_s=window_s, options=options)

    @property
    def label(self) -> str:
        """ "status:<code>" for "status" faults, else the kind ("mixed" faults are recorded as the kind served)."""
        return f"status:{self.status}" if self.kind == "status" else self.kind

    def _expired(self, now: float) -> bool:
        return (
            self.window_s is not None
            and self._window_started is not None
            and now - self._window_started >= self.window_s
        )


def _as_fault(kind: "str | Fault") -> Fault:
    if isinstance(kind, Fault):
        return replace(kind)  # a copy: options are shared by nobody
    if kind.startswith("status:"):
        return Fault(kind="status", status=int(kind.split(":", 1)[1]))
    return Fault(kind=kind)  # type: ignore[arg-type] - validated by __post_init__


DEFAULT_MIX: tuple["str | Fault", ...] = (
    "malformed",
    "no_choices",
    "empty",
    "truncate",
    "reset",
    "drop",
    "status:500",
    Fault(kind="status", status=429, retry_after=1),
)
"""The mix ``Fault.mixed`` uses by default: every reply fault a proxy sees, 429 with ``Retry-After: 1``."""


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


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # headers and body are two writes: with Nagle on, a keep-alive client's delayed ACK adds ~40 ms per request
    disable_nagle_algorithm = True
    server: "_HTTPServer"

    def setup(self) -> None:
        super().setup()
        self.server.owner._track(self.connection, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.owner._track(self.connection, add=False)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # keep test output quiet

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path in _MODELS_PATHS:
            models = [{"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in self.server.owner.models]
            self._send(200, {"object": "list", "data": models})
        else:
            self.server.owner._count_invalid()
            self._send(404, error_body(404, f"unknown path {self.path}"))

    def do_POST(self) -> None:
        body = self._read_body()
        path = self.path.split("?", 1)[0].rstrip("/")
        if path not in _CHAT_PATHS:
            self.server.owner._count_invalid()
            self._send(404, error_body(404, f"unknown path {self.path}"))
            return
        try:
            request = parse_chat_request(body)
        except BadRequest as exc:
            self.server.owner._count_invalid()
            self._send(400, error_body(400, str(exc)))
            return
        retry_header = self.headers.get("x-stainless-retry-count")
        retry_count = int(retry_header) if retry_header and retry_header.isdigit() else None
        try:
            outcome = self.server.owner._handle(request, retry_count)
        except _Dropped as dropped:
            self._reset() if dropped.reset else self._drop()
            return
        self._send(outcome.status, outcome.body, outcome.headers)

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _send(self, status: int, payload: dict[str, Any] | bytes, headers: dict[str, str] | None = None) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode("utf-8")
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.close_connection = True  # the client gave up (e.g. its timeout fired)

    def _drop(self) -> None:
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _reset(self) -> None:
        """Close with RST: no shutdown first (that would send a FIN), linger on with a zero timeout. The read
        file holds a reference to the socket, so it is closed first for ``close()`` to release the descriptor
        now; the later shutdown/close of ``finish`` and the server then fail quietly on the closed socket."""
        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.rfile.close()
            self.connection.close()
        except OSError:
            pass


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024  # the default backlog (5) makes bursts of connects wait for SYN retransmits (1 s)

    def __init__(self, address: tuple[str, int], owner: "FakeOpenAIServer") -> None:
        self.owner = owner
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # connection resets during stop() or client timeouts are expected


class FakeOpenAIServer:
    """``with FakeOpenAIServer(responder) as srv: AsyncOpenAI(base_url=srv.base_url, api_key="x")``."""

    def __init__(
        self,
        responder: Responder,
        *,
        supports_n: bool = True,
        supports_tools: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
        latency: Callable[[ChatRequest], float] | None = None,
        max_concurrency: int | None = None,
        models: tuple[str, ...] | None = None,
        seed: int = 0,
    ) -> None:
        """``seed`` seeds the RNG behind ``Fault.rate`` draws and ``Fault.mixed`` picks: the same seed and the same
        sequence of requests give the same faults (with concurrent requests, the arrival order decides)."""
        self.responder = responder
        self.supports_n = supports_n
        self.supports_tools = supports_tools
        self.latency = latency
        # what GET /models lists: given, else what the responder says it serves (its ``models``), else fake-model
        self.models = models or tuple(getattr(responder, "models", ("fake-model",)))
        self._address = (host, port)
        self._semaphore = threading.BoundedSemaphore(max_concurrency) if max_concurrency else None
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._rng = random.Random(seed)
        self._stats = ServerStats()
        self._stopping = threading.Event()
        self._connections: set[socket.socket] = set()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # lifecycle ------------------------------------------------------------------------------------------
    def start(self) -> "FakeOpenAIServer":
        if self._httpd is not None:
            return self
        self._stopping.clear()
        self._httpd = _HTTPServer(self._address, self)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"fake-openai-{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._stopping.set()  # wakes sleeping handlers (latency, delay faults)
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:  # idle keep-alive connections would otherwise linger
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd, self._thread = None, None

    def __enter__(self) -> "FakeOpenAIServer":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("server is not started")
        return self._httpd.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://{self._address[0]}:{self.port}/v1"

    # faults and stats -----------------------------------------------------------------------------------
    def inject(self, fault: Fault) -> Fault:
        with self._lock:
            self._faults.append(fault)
        return fault

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    @property
    def pending_faults(self) -> list[Fault]:
        """The faults not yet consumed (window faults whose window has passed are removed here too)."""
        now = time.monotonic()
        with self._lock:
            self._faults[:] = [f for f in self._faults if not f._expired(now)]
            return list(self._faults)

    @property
    def stats(self) -> ServerStats:
        return self._stats

    def reset_stats(self) -> None:
        with self._lock:
            in_flight = self._stats.in_flight
            # in place, so references held by callers see the reset
            self._stats.__init__(in_flight=in_flight, max_in_flight=in_flight)  # type: ignore[misc]

    # request handling -----------------------------------------------------------------------------------
    def _track(self, conn: socket.socket, *, add: bool) -> None:
        with self._lock:
            (self._connections.add if add else self._connections.discard)(conn)

    def _count_invalid(self) -> None:
        with self._lock:
            self._stats.requests += 1
            self._stats.invalid += 1

    def _take_fault(self, request: ChatRequest) -> Fault | None:
        """The fault to serve (a "mixed" one resolved to the option picked), consuming or expiring faults."""
        now = time.monotonic()
        with self._lock:
            for fault in list(self._faults):
                if fault._expired(now):
                    self._faults.remove(fault)
                    continue
                if fault.match is not None and not fault.match(request):
                    continue
                if fault.window_s is not None and fault._window_started is None:
                    fault._window_started = now
                if fault.rate is not None:
                    if self._rng.random() >= fault.rate:
                        continue
                elif fault.window_s is None:
                    fault.times -= 1
                    if fault.times <= 0:
                        self._faults.remove(fault)
                served = self._rng.choice(fault.options) if fault.kind == "mixed" else fault
                self._stats.faults_served[served.label] += 1
                return served
        return None

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
            headers = {"Retry-After": _format_seconds(fault.retry_after)} if fault.retry_after is not None else {}
            return _Outcome(fault.status, error_body(fault.status, f"injected fault: HTTP {fault.status}"), headers)
        if fault is not None and kind == "delay":
            self._stopping.wait(fault.delay_s)
        if self.latency is not None:
            self._stopping.wait(max(0.0, self.latency(request)))
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
        except Exception as exc:  # a responder bug becomes a visible 500, not a hung client
            return _Outcome(500, error_body(500, f"responder failed: {type(exc).__name__}: {exc}"))
        if not self.supports_n:
            contents = contents[:1]
        return _Outcome(200, completion_body(request, contents, cut_words=cut_words), choices=len(contents))


def _format_seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
