"""A loopback OpenAI-compatible ``/v1/embeddings`` server for tests (stdlib only), with two vector functions:
``fake_vector`` (a hash: unrelated texts, no semantics) and ``bag_of_words`` (texts sharing words are similar,
so near-duplicate control can be tested without a model). Faults come from the fault model the fakes share
(``clgrpo.testing.faults``)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable

from clgrpo.testing.fake_openai import error_body
from clgrpo.testing.faults import WIRE_KINDS, retry_after_header
from clgrpo.testing.loopback import LoopbackHandler, LoopbackServer

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


class _Handler(LoopbackHandler):
    def do_POST(self) -> None:
        body = json.loads(self.read_body())
        owner = self.server.owner
        owner.requests.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
        fault = owner.take_fault(body)
        if fault is not None and fault.kind in ("drop", "reset"):
            self.reset() if fault.kind == "reset" else self.drop()
        elif fault is not None and fault.kind == "status":
            message = fault.message or f"injected fault: HTTP {fault.status}"
            self.send_json(fault.status, error_body(fault.status, message), retry_after_header(fault))
        elif self.path != "/v1/embeddings":
            self.send_json(404, {"error": {"message": f"no route {self.path}"}})
        else:
            if fault is not None and fault.kind == "delay":
                owner.wait(fault.delay_s)
            payload = owner.answer(body)
            if fault is not None and fault.kind == "malformed":  # cut in half: no longer JSON
                data = json.dumps(payload).encode()
                self.send_json(200, data[: len(data) // 2])
            else:
                self.send_json(200, payload)


class EmbeddingServer(LoopbackServer):
    """A loopback /v1/embeddings server, started on construction: injected faults first (``inject(Fault(...))``
    of ``clgrpo.testing.faults``; "match" sees the request body), then real answers (``vector(text)``, default
    ``fake_vector``), the rows listed in reverse index order (clients must sort by ``index``). ``requests``
    records every POST (path, body, Authorization)."""

    handler_class = _Handler
    thread_name = "fake-embeddings"
    fault_kinds = WIRE_KINDS

    def __init__(self, vector: Callable[[str], list[float]] | None = None, *, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.vector = vector or fake_vector
        self.requests: list[dict] = []
        self.start()

    @property
    def base_url(self) -> str:
        return f"{self.origin}/v1"

    def answer(self, body: dict) -> dict:
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = [{"object": "embedding", "index": i, "embedding": self.vector(t)} for i, t in enumerate(inputs)]
        return {
            "object": "list",
            "data": data[::-1],
            "model": body["model"],
            "usage": {"prompt_tokens": 1, "total_tokens": 1},
        }
