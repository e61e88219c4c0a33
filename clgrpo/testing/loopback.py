"""The one base of the loopback HTTP servers that tests and benchmarks talk to (stdlib only).

A ``LoopbackServer`` binds 127.0.0.1 (port 0: a free one), serves in a daemon thread, closes idle keep-alive
connections on ``stop`` and is a context manager. Its handlers (``LoopbackHandler``) are quiet (no access log, no
tracebacks for clients that hung up) and know the wire side of the fault model (``clgrpo.testing.faults``):
answering JSON with extra headers, dropping a connection (FIN) or resetting it (RST).
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from clgrpo.testing.faults import Fault, FaultPlan

__all__ = ["LoopbackHandler", "LoopbackServer"]


class LoopbackHandler(BaseHTTPRequestHandler):
    """A quiet request handler whose connections its ``LoopbackServer`` can close; ``self.server.owner`` is that
    server."""

    server: _HTTPServer

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

    def read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def send_json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        """``payload`` as JSON (bytes are sent as they are: a malformed body), with ``headers``; a client that
        has gone (its timeout fired) ends the connection quietly."""
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
        except OSError:  # BrokenPipeError, ConnectionResetError
            self.close_connection = True

    def drop(self) -> None:
        """Close the connection cleanly (FIN) without answering."""
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def reset(self) -> None:
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

    def __init__(
        self, address: tuple[str, int], handler: Callable[..., BaseHTTPRequestHandler], owner: LoopbackServer
    ) -> None:
        self.owner: Any = owner  # the LoopbackServer subclass: its handlers call its own methods
        super().__init__(address, handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # connection resets during stop() or client timeouts are expected


class LoopbackServer:
    """Serves ``handler_class`` (a ``LoopbackHandler``; its ``server.owner`` is this object) on ``host:port``
    in a thread: ``with Server(...) as srv: ... srv.origin``. ``start`` and ``stop`` may be called again.
    Faults: ``inject(Fault(...))`` of the kinds in ``fault_kinds``; the handler serves ``take_fault(request)``.
    ``seed`` seeds the RNG behind ``Fault.rate`` draws and ``Fault.mixed`` picks."""

    handler_class: type[LoopbackHandler] = LoopbackHandler
    thread_name = "loopback"
    fault_kinds: frozenset[str] = frozenset()  # the fault kinds this server serves (none: faults are refused)

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, seed: int = 0) -> None:
        self._faults = FaultPlan(seed, kinds=self.fault_kinds)
        self._address = (host, port)
        self._lock = threading.Lock()
        self._stopping = threading.Event()  # set by stop(): handlers waiting on it (latency, delays) wake up
        self._connections: set[socket.socket] = set()
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> Self:
        if self._httpd is not None:
            return self
        self._stopping.clear()
        self._httpd = _HTTPServer(self._address, self.make_handler(), self)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"{self.thread_name}-{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def make_handler(self) -> Callable[..., BaseHTTPRequestHandler]:
        """What serves each request: ``handler_class``, or a subclass's factory (a handler with arguments)."""
        return self.handler_class

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._stopping.set()
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

    def close(self) -> None:
        self.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("server is not started")
        return self._httpd.server_address[1]

    @property
    def thread(self) -> threading.Thread:
        """The serving thread (while started)."""
        if self._thread is None:
            raise RuntimeError("server is not started")
        return self._thread

    @property
    def origin(self) -> str:
        """``http://host:port``, without a path."""
        return f"http://{self._address[0]}:{self.port}"

    def inject(self, fault: Fault) -> Fault:
        return self._faults.inject(fault)

    def clear_faults(self) -> None:
        self._faults.clear()

    @property
    def pending_faults(self) -> list[Fault]:
        """The faults not yet consumed (window faults whose window has passed are removed here too)."""
        return self._faults.pending()

    def take_fault(self, request: Any) -> Fault | None:
        """The fault to serve for ``request`` (see ``FaultPlan.take``), None: answer normally."""
        return self._faults.take(request)

    def wait(self, seconds: float) -> None:
        """Sleep ``seconds`` in a handler, or less when the server stops."""
        self._stopping.wait(seconds)

    def _track(self, conn: socket.socket, *, add: bool) -> None:
        with self._lock:
            (self._connections.add if add else self._connections.discard)(conn)
