"""A latency-controlled OpenAI-compatible server for benchmarks (loopback, its own process).

Built on ``clgrpo.testing.fake_openai.FakeOpenAIServer``; replies come from
``clgrpo.testing.scripted_llm.ScriptedWorld`` (the same prompt contract the test suite uses). Each call takes

    time to first token (lognormal, median ``median_s``, shape ``sigma``; with probability ``tail_p`` a Pareto
    straggler ``tail_scale_s * U**(-1/tail_alpha)`` instead, capped at ``max_s``)
    + completion tokens of the longest choice / ``tokens_per_s``

drawn deterministically from the request's content (messages, n and sampling seed), so two pipeline designs that
send the same requests see the same latencies. The server holds at most ``max_concurrency`` requests in service;
more wait in its accept queue.

Agent rollouts: a policy request that lists tools (or shows the text protocol) gets the scripted world's ReAct
agent (``ScriptedWorld._agent``: call the python tool, then answer what it printed); every turn is one call
with its own latency draw. World options for agent benchmarks (``LatencyServerProcess(world_options=...)``):
``tag_tool_calls`` appends `` [call N]`` to each reply that calls a tool, so the next turn's request (which
carries that reply) names the call it follows (``CallRecord.tag``/``parent``: the turn chains of the critical
path); ``distinct_repeats`` gives a request whose messages and seed repeat an earlier one its own reply and
latency draw (by arrival order) instead of the same one; ``p_base`` etc. go to ``ScriptedWorld``.

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
import re
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from clgrpo.testing.fake_openai import ChatRequest, FakeOpenAIServer, Reply, RequestLogEntry, role_of  # noqa: E402
from clgrpo.testing.scripted_llm import PROBLEM_RE, REPAIR_PREFIX, ScriptedWorld  # noqa: E402


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

    def first_token_s(self, request: ChatRequest, repeat: int = 0) -> float:
        rng = random.Random(_request_key(request, self.seed, repeat))
        if rng.random() < self.tail_p:
            value = self.tail_scale_s * (1.0 - rng.random()) ** (-1.0 / self.tail_alpha)
        else:
            value = self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))
        return min(value, self.max_s)

    def generation_s(self, contents: list[str | Reply]) -> float:
        longest = max((len(_reply_text(c).split()) for c in contents), default=0)  # the server counts words
        return longest / self.tokens_per_s if self.tokens_per_s > 0 else 0.0


def _reply_text(reply: str | Reply) -> str:
    """A choice's generated text: the content, and the arguments of the tools it calls."""
    if not isinstance(reply, Reply):
        return reply
    calls = " ".join(a if isinstance(a, str) else json.dumps(a) for _, a in reply.tool_calls)
    return f"{reply.content or ''} {calls}".strip()


def _stable_messages(messages: list[dict]) -> list[dict]:
    """Messages without the tool-call ids the server made up (random), so agent turns draw reproducibly."""
    if not any("tool_calls" in m or "tool_call_id" in m for m in messages):
        return messages
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if k != "tool_call_id"}
        if m.get("tool_calls"):
            m["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in m["tool_calls"]]
        out.append(m)
    return out


def _request_key(request: ChatRequest, seed: int, repeat: int = 0) -> int:
    fields = [seed, request.n, request.seed, _stable_messages(request.messages)] + ([repeat] if repeat else [])
    payload = json.dumps(fields, sort_keys=True).encode("utf-8")
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "big")


_TAG_RE = re.compile(r"\[call (\d+)\]")


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
    # agent rollouts (policy calls): the turn (assistant messages in the request), the tag of the tool call this
    # reply made, the tag of the call whose tool result this request carries (None: a rollout's first turn), and
    # the tool time between that call and this one (set by the benchmark from the flow's measurements)
    turn: int = 0
    tag: str | None = None
    parent: str | None = None
    gap_s: float = 0.0


class SeededWorld(ScriptedWorld):
    """The scripted world, but a request's sampling seed (the client sends seed + i for sample i) picks its
    reply instead of the order in which identical requests arrive: every run gets the same replies.

    ``distinct_repeats``: a request whose messages and seed were seen before gets the next reply by arrival
    order (G samples sent with one seed still differ). ``tag_tool_calls``: a reply that calls a tool ends its
    text with `` [call N]`` (N counts the world's tool calls)."""

    def __init__(
        self, seed: int = 0, *, distinct_repeats: bool = False, tag_tool_calls: bool = False, **kwargs: object
    ) -> None:
        super().__init__(seed=seed, **kwargs)
        self.distinct_repeats = distinct_repeats
        self.tag_tool_calls = tag_tool_calls
        self._repeats: dict[tuple[str, int | None], int] = {}
        self._tags = 0

    def _occurrence(self, request: ChatRequest) -> tuple[str, int | str]:
        digest, seen = super()._occurrence(request)
        if request.seed is None:
            return digest, seen
        if self.distinct_repeats:
            with self._lock:
                repeat = self._repeats.get((digest, request.seed), 0)
                self._repeats[(digest, request.seed)] = repeat + 1
            if repeat:
                return digest, f"{request.seed}+{repeat}"
        return digest, request.seed

    def _tool_call(self, protocol: str | None, text: str, code: str) -> str | Reply:
        if self.tag_tool_calls:
            with self._lock:
                self._tags += 1
                text = f"{text} [call {self._tags}]"
        return super()._tool_call(protocol, text, code)


class PacedResponder:
    """Wraps a responder: draws the time to first token (the server's ``latency``), sleeps the generation time
    of its reply and records the call."""

    def __init__(self, inner: SeededWorld, model: LatencyModel) -> None:
        self.models = inner.models
        self.inner = inner
        self.model = model
        self.records: list[CallRecord] = []
        self._lock = threading.Lock()
        self._repeats: dict[int, int] = {}
        self._drawn = threading.local()  # the handler thread's draw, from latency() to __call__

    def latency(self, request: ChatRequest) -> float:
        repeat = 0
        if getattr(self.inner, "distinct_repeats", False):
            key = _request_key(request, self.model.seed)
            with self._lock:
                repeat = self._repeats.get(key, 0)
                self._repeats[key] = repeat + 1
        self._drawn.value = self.model.first_token_s(request, repeat)
        return self._drawn.value

    def __call__(self, request: ChatRequest) -> list[str | Reply]:
        contents = self.inner(request)
        first_token = getattr(self._drawn, "value", None)
        self._drawn.value = None
        generation = self.model.generation_s(contents)
        time.sleep(generation)
        users = [m["content"] for m in request.messages if m.get("role") == "user"]
        match = PROBLEM_RE.search("\n".join(users))
        said = [_TAG_RE.findall(m["content"] or "") for m in request.messages if m.get("role") == "assistant"]
        parents = [t for tags in said for t in tags]
        tags = [t for c in contents for t in _TAG_RE.findall(_reply_text(c))]
        record = CallRecord(
            role=role_of(request),
            group=match.group(0) if match else None,
            repair=bool(users) and users[-1].startswith(REPAIR_PREFIX),
            service_s=(self.model.first_token_s(request) if first_token is None else first_token) + generation,
            ended=time.monotonic(),
            tokens_in=sum(len(m["content"].split()) for m in request.messages),
            tokens_out=sum(len(_reply_text(c).split()) for c in contents),
            turn=len(said),
            tag=tags[0] if tags else None,
            parent=parents[-1] if parents else None,
        )
        with self._lock:
            self.records.append(record)
        return contents


def make_server(
    model: LatencyModel, *, supports_n: bool, world_seed: int = 0, port: int = 0, world_options: dict | None = None
) -> tuple[FakeOpenAIServer, PacedResponder]:
    responder = PacedResponder(SeededWorld(seed=world_seed, **(world_options or {})), model)
    server = FakeOpenAIServer(
        responder, supports_n=supports_n, port=port, latency=responder.latency, max_concurrency=model.max_concurrency
    )
    return server, responder


@dataclass
class Collected:
    records: list[CallRecord]
    log: list[RequestLogEntry]
    max_in_flight: int
    clock_offset_s: float  # this process's monotonic clock minus the server's (same host: ~0)


def _serve(conn, model: LatencyModel, supports_n: bool, world_seed: int, world_options: dict | None = None) -> None:
    server, responder = make_server(model, supports_n=supports_n, world_seed=world_seed, world_options=world_options)
    with server:
        conn.send(server.base_url)
        while True:
            command = conn.recv()
            if command == "collect":
                conn.send(
                    (list(responder.records), list(server.stats.log), server.stats.max_in_flight, time.monotonic())
                )
            elif isinstance(command, tuple) and command[0] == "reset":
                model = replace(model, seed=command[1])
                responder.model = model
                responder.records.clear()
                responder._repeats.clear()
                responder.inner = SeededWorld(seed=world_seed, **(world_options or {}))
                server.reset_stats()
                conn.send("ok")
            else:
                conn.send("bye")
                return


class LatencyServerProcess:
    """The latency server in a child process, so its threads do not compete with the pipeline for the GIL."""

    def __init__(
        self, model: LatencyModel, *, supports_n: bool = False, world_seed: int = 0, world_options: dict | None = None
    ) -> None:
        self.model = model
        self._args = (model, supports_n, world_seed, world_options)
        self._conn = None
        self._process: multiprocessing.Process | None = None
        self.base_url = ""

    _serve = staticmethod(_serve)  # what runs in the child (benchmarks/async_server.py passes its own)

    def __enter__(self) -> "LatencyServerProcess":
        context = multiprocessing.get_context("spawn")
        parent, child = context.Pipe()
        self._process = context.Process(target=self._serve, args=(child, *self._args), daemon=True)
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
            while True:  # timed sleeps: a Ctrl-C delivered to a server thread is noticed here within 0.5 s
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
