"""A loopback OpenAI-compatible ``/v1/embeddings`` server for tests (stdlib only), with two vector functions:
``fake_vector`` (a hash: unrelated texts, no semantics) and ``bag_of_words`` (texts sharing words are similar,
so near-duplicate control can be tested without a model)."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["EmbeddingServer", "bag_of_words", "fake_vector"]


def bag_of_words(text: str, dim: int = 256) -> list[float]:
    """Counts of the text's lower-cased words hashed into ``dim`` buckets (not normalised)."""
    vector = [0.0] * dim
    for word in re.findall(r"[a-z0-9]+", text.casefold()):
        vector[int.from_bytes(hashlib.sha256(word.encode()).digest()[:4], "big") % dim] += 1.0
    return vector


def fake_vector(text: str, dim: int = 8) -> list[float]:
    """Deterministic, not normalised (the client normalises)."""
    digest = hashlib.sha256(text.encode()).digest()
    return [(b - 128) / 16.0 for b in digest[:dim]]


class EmbeddingServer:
    """A loopback /v1/embeddings server: queued faults first (status, body, headers), then real answers
    (``vector(text)``, default ``fake_vector``), the rows listed in reverse index order (clients must sort by
    ``index``)."""

    def __init__(self, vector: Callable[[str], list[float]] | None = None) -> None:
        self.vector = vector or fake_vector
        self.faults: list[tuple[int, dict, dict]] = []
        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
                if outer.faults:
                    status, payload, headers = outer.faults.pop(0)
                elif self.path != "/v1/embeddings":
                    status, payload, headers = 404, {"error": {"message": f"no route {self.path}"}}, {}
                else:
                    inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
                    data = [
                        {"object": "embedding", "index": i, "embedding": outer.vector(t)} for i, t in enumerate(inputs)
                    ]
                    status, headers = 200, {}
                    payload = {
                        "object": "list",
                        "data": data[::-1],
                        "model": body["model"],
                        "usage": {"prompt_tokens": 1, "total_tokens": 1},
                    }
                raw = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(raw)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
