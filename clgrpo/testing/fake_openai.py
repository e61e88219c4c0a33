"""A fake OpenAI-compatible HTTP server for tests and benchmarks (stdlib only).

The official ``openai`` SDK talks to it unchanged (``base_url=server.base_url``). A ``Responder`` produces the
choice contents; the server adds the chat.completion envelope, usage counts, optional latency, a concurrency
cap, fault injection (HTTP errors, delays, dropped connections) and thread-safe request statistics.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal, Protocol

__all__ = [
    "ChatRequest",
    "Fault",
    "FakeOpenAIServer",
    "RequestLogEntry",
    "Responder",
    "ServerStats",
    "message_text",
    "role_of",
]

POLICY_ROLE = "policy"
_CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
_MODELS_PATHS = ("/v1/models", "/models")
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                408: "timeout", 409: "conflict", 429: "rate_limit_exceeded"}


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
    raw: dict[str, Any] = field(default_factory=dict)


class Responder(Protocol):
    def __call__(self, request: ChatRequest) -> list[str]:
        """One content string per choice (normally ``request.n`` of them)."""
        ...


@dataclass
class Fault:
    """A scripted failure. ``kind``: "status" answers ``status`` (with ``Retry-After`` if set); "delay" sleeps
    ``delay_s`` and then answers normally; "drop" closes the connection without any response."""

    kind: Literal["status", "delay", "drop"] = "status"
    match: Callable[[ChatRequest], bool] | None = None  # None: any request
    times: int = 1  # matching requests affected before the fault is consumed
    status: int = 500
    retry_after: float | None = None  # seconds, sent as the Retry-After header
    delay_s: float = 0.0

    @property
    def label(self) -> str:
        return f"status:{self.status}" if self.kind == "status" else self.kind


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
    requests: int = 0
    invalid: int = 0  # malformed bodies (400) and unknown paths (404)
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
                return first[len("ROLE:"):].strip()
            return POLICY_ROLE
    return POLICY_ROLE


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
        raw=raw,
    )


def _cap(content: str, max_tokens: int | None) -> tuple[str, str]:
    """A reply longer than ``max_tokens`` words (this server's tokens) is cut there, as a real server cuts it,
    with ``finish_reason: "length"``."""
    if max_tokens is None or _words(content) <= max_tokens:
        return content, "stop"
    return " ".join(content.split()[:max_tokens]), "length"


def completion_body(request: ChatRequest, contents: list[str]) -> dict[str, Any]:
    capped = [_cap(c, request.max_tokens) for c in contents]
    contents = [c for c, _ in capped]
    prompt_tokens = sum(_words(m["content"]) for m in request.messages)
    completion_tokens = sum(_words(c) for c in contents)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model,
        "choices": [
            {"index": i, "message": {"role": "assistant", "content": c}, "finish_reason": finish, "logprobs": None}
            for i, (c, finish) in enumerate(zip(contents, (f for _, f in capped)))
        ],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": kind if status != 400 else None, "param": None}}


class _Dropped(Exception):
    """Raised inside a handler to close the connection without answering."""


@dataclass
class _Outcome:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    choices: int = 0


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
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
        except _Dropped:
            self._drop()
            return
        self._send(outcome.status, outcome.body, outcome.headers)

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _send(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode("utf-8")
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
        host: str = "127.0.0.1",
        port: int = 0,
        latency: Callable[[ChatRequest], float] | None = None,
        max_concurrency: int | None = None,
        models: tuple[str, ...] | None = None,
    ) -> None:
        self.responder = responder
        self.supports_n = supports_n
        self.latency = latency
        # what GET /models lists: given, else what the responder says it serves (its ``models``), else fake-model
        self.models = models or tuple(getattr(responder, "models", ("fake-model",)))
        self._address = (host, port)
        self._semaphore = threading.BoundedSemaphore(max_concurrency) if max_concurrency else None
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
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
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"fake-openai-{self.port}", daemon=True)
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
        with self._lock:
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
        with self._lock:
            for fault in self._faults:
                if fault.match is None or fault.match(request):
                    fault.times -= 1
                    if fault.times <= 0:
                        self._faults.remove(fault)
                    self._stats.faults_served[fault.label] += 1
                    return fault
        return None

    def _enter(self, role: str) -> None:
        with self._lock:
            stats = self._stats
            stats.requests += 1
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
            self._exit(RequestLogEntry(role=role, n=request.n, status=status, started=started,
                                       ended=time.monotonic(), choices=choices,
                                       fault=fault.label if fault else None, retry_count=retry_count))
            if self._semaphore is not None:
                self._semaphore.release()

    def _answer(self, request: ChatRequest, fault: Fault | None) -> _Outcome:
        if fault is not None and fault.kind == "drop":
            raise _Dropped
        if fault is not None and fault.kind == "status":
            headers = {"Retry-After": _format_seconds(fault.retry_after)} if fault.retry_after is not None else {}
            return _Outcome(fault.status, error_body(fault.status, f"injected fault: HTTP {fault.status}"), headers)
        if fault is not None and fault.kind == "delay":
            self._stopping.wait(fault.delay_s)
        if self.latency is not None:
            self._stopping.wait(max(0.0, self.latency(request)))
        return self._complete(request)

    def _complete(self, request: ChatRequest) -> _Outcome:
        asked = request if self.supports_n else replace(request, n=1)
        try:
            contents = [str(c) for c in self.responder(asked)]
        except Exception as exc:  # a responder bug becomes a visible 500, not a hung client
            return _Outcome(500, error_body(500, f"responder failed: {type(exc).__name__}: {exc}"))
        if not self.supports_n:
            contents = contents[:1]
        return _Outcome(200, completion_body(request, contents), choices=len(contents))


def _format_seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
