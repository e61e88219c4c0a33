"""A latency-controlled OpenAI-compatible server for benchmarks (loopback, its own process).

Built on ``clgrpo.testing.fake_openai.FakeOpenAIServer``; replies come from ``tests.scripted_llm.ScriptedWorld``
(the same prompt contract the test suite uses). Each call takes

    time to first token (lognormal, median ``median_s``, shape ``sigma``; with probability ``tail_p`` a Pareto
    straggler ``tail_scale_s * U**(-1/tail_alpha)`` instead, capped at ``max_s``)
    + completion tokens of the longest choice / ``tokens_per_s``

drawn deterministically from the request's content (messages, n and sampling seed), so two pipeline designs that send the
same requests see the same latencies. The server holds at most ``max_concurrency`` requests in service; more
wait in its accept queue.

Run standalone:  python benchmarks/latency_server.py --port 8000 --median-s 1.0
In a benchmark:  ``with LatencyServerProcess(LatencyModel(...)) as srv: ... srv.base_url ... srv.collect()``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from clgrpo.testing.fake_openai import ChatRequest, FakeOpenAIServer, RequestLogEntry, role_of  # noqa: E402
from tests.scripted_llm import REPAIR_PREFIX, PROBLEM_RE, ScriptedWorld  # noqa: E402


@dataclass(frozen=True)
class LatencyModel:
    median_s: float = 0.8
    sigma: float = 0.5
    tail_p: float = 0.02
    tail_scale_s: float = 2.0
    tail_alpha: float = 1.5
    max_s: float = 6.0
    tokens_per_s: float = 100.0  # 0: no generation time
    max_concurrency: int = 512
    seed: int = 0

    def first_token_s(self, request: ChatRequest) -> float:
        rng = random.Random(_request_key(request, self.seed))
        if rng.random() < self.tail_p:
            value = self.tail_scale_s * (1.0 - rng.random()) ** (-1.0 / self.tail_alpha)
        else:
            value = self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        return min(value, self.max_s)

    def generation_s(self, contents: list[str]) -> float:
        longest = max((len(c.split()) for c in contents), default=0)  # the server counts words as tokens
        return longest / self.tokens_per_s if self.tokens_per_s > 0 else 0.0


def _request_key(request: ChatRequest, seed: int) -> int:
    payload = json.dumps([seed, request.n, request.seed, request.messages], sort_keys=True).encode("utf-8")
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "big")


@dataclass(frozen=True)
class CallRecord:
    """One answered request as the critical-path model needs it."""

    role: str
    group: str | None  # the problem text the request is about (None: consolidation)
    repair: bool  # a repair re-ask (depends on the first ask of the same group)
    service_s: float  # drawn first-token time + generation time
    ended: float  # time.monotonic() in the server process
    tokens_in: int
    tokens_out: int


class SeededWorld(ScriptedWorld):
    """The scripted world, but a request's sampling seed (the client sends seed + i for sample i) picks its
    reply instead of the order in which identical requests arrive: every run gets the same replies."""

    def _occurrence(self, request: ChatRequest) -> tuple[str, int]:
        digest, seen = super()._occurrence(request)
        return digest, seen if request.seed is None else request.seed


class PacedResponder:
    """Wraps a responder: sleeps the generation time of its reply and records the call."""

    def __init__(self, inner: SeededWorld, model: LatencyModel) -> None:
        self.models = inner.models
        self.inner = inner
        self.model = model
        self.records: list[CallRecord] = []
        self._lock = threading.Lock()

    def __call__(self, request: ChatRequest) -> list[str]:
        contents = self.inner(request)
        generation = self.model.generation_s(contents)
        time.sleep(generation)
        users = [m["content"] for m in request.messages if m.get("role") == "user"]
        match = PROBLEM_RE.search("\n".join(users))
        record = CallRecord(
            role=role_of(request), group=match.group(0) if match else None,
            repair=bool(users) and users[-1].startswith(REPAIR_PREFIX),
            service_s=self.model.first_token_s(request) + generation, ended=time.monotonic(),
            tokens_in=sum(len(m["content"].split()) for m in request.messages),
            tokens_out=sum(len(c.split()) for c in contents))
        with self._lock:
            self.records.append(record)
        return contents


def make_server(model: LatencyModel, *, supports_n: bool, world_seed: int = 0,
                port: int = 0) -> tuple[FakeOpenAIServer, PacedResponder]:
    responder = PacedResponder(SeededWorld(seed=world_seed), model)
    server = FakeOpenAIServer(responder, supports_n=supports_n, port=port, latency=model.first_token_s,
                              max_concurrency=model.max_concurrency)
    return server, responder


@dataclass
class Collected:
    records: list[CallRecord]
    log: list[RequestLogEntry]
    max_in_flight: int
    clock_offset_s: float  # this process's monotonic clock minus the server's (same host: ~0)


def _serve(conn, model: LatencyModel, supports_n: bool, world_seed: int) -> None:
    server, responder = make_server(model, supports_n=supports_n, world_seed=world_seed)
    with server:
        conn.send(server.base_url)
        while True:
            command = conn.recv()
            if command == "collect":
                conn.send((list(responder.records), list(server.stats.log), server.stats.max_in_flight,
                           time.monotonic()))
            elif isinstance(command, tuple) and command[0] == "reset":
                model = replace(model, seed=command[1])
                server.latency, responder.model = model.first_token_s, model
                responder.records.clear()
                responder.inner = SeededWorld(seed=world_seed)
                server.reset_stats()
                conn.send("ok")
            else:
                conn.send("bye")
                return


class LatencyServerProcess:
    """The latency server in a child process, so its threads do not compete with the pipeline for the GIL."""

    def __init__(self, model: LatencyModel, *, supports_n: bool = False, world_seed: int = 0) -> None:
        self.model = model
        self._args = (model, supports_n, world_seed)
        self._conn = None
        self._process: multiprocessing.Process | None = None
        self.base_url = ""

    def __enter__(self) -> "LatencyServerProcess":
        parent, child = multiprocessing.get_context("spawn").Pipe()
        self._process = multiprocessing.get_context("spawn").Process(target=_serve, args=(child, *self._args),
                                                                     daemon=True)
        self._process.start()
        self._conn = parent
        self.base_url = parent.recv()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._conn is not None:
            self._conn.send("stop")
            self._conn.recv()
        if self._process is not None:
            self._process.join(timeout=10)

    def reset(self, latency_seed: int = 0) -> None:
        """Forget the calls served so far, start a fresh scripted world (same seed) and draw latencies with
        ``latency_seed``."""
        self._conn.send(("reset", latency_seed))
        self._conn.recv()

    def collect(self) -> Collected:
        sent = time.monotonic()
        self._conn.send("collect")
        records, log, max_in_flight, server_now = self._conn.recv()
        received = time.monotonic()
        return Collected(records, log, max_in_flight, (sent + received) / 2 - server_now)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--no-n", action="store_true", help="ignore n: one choice per request")
    for name, value in asdict(LatencyModel()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    model = LatencyModel(**{k: args[k] for k in asdict(LatencyModel())})
    server, _ = make_server(model, supports_n=not args["no_n"], port=args["port"])
    with server:
        print(f"serving {server.base_url} with {model}", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
