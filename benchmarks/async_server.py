"""The latency server on an asyncio front end (aiohttp on uvloop), for workloads of hundreds to thousands of
requests per second that the threaded ``FakeOpenAIServer`` (one thread per connection, ~1 ms of CPU per
request) would itself bottleneck on two cores.

Same replies (``SeededWorld``), same latency draws (``LatencyModel``), same records (``CallRecord``, request log,
``max_in_flight``) and the same parent-side interface as ``LatencyServerProcess``; a request waits its drawn
latency with ``asyncio.sleep`` instead of holding a thread. Used by ``benchmarks/scale.py`` and
``benchmarks/client_cpu.py``; ``--canned`` answers every request with one fixed short reply (no scripted world),
for measuring a client alone.

Run standalone:  python benchmarks/async_server.py --port 8000 --median-s 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from latency_server import (  # noqa: E402
    LatencyModel,
    LatencyServerProcess,
    PacedResponder,
    SeededWorld,
)

from clgrpo.testing.fake_openai import (  # noqa: E402
    BadRequest,
    RequestLogEntry,
    completion_body,
    error_body,
    parse_chat_request,
    role_of,
)


class AsyncLatencyApp:
    """The request handler and its bookkeeping (one event loop, so no locks are needed)."""

    def __init__(
        self,
        model: LatencyModel,
        *,
        supports_n: bool,
        world_seed: int = 0,
        canned: str | None = None,
        world_options: dict | None = None,
    ) -> None:
        self.supports_n = supports_n
        self.world_seed, self.world_options, self.canned = world_seed, world_options, canned
        self.responder = PacedResponder(SeededWorld(seed=world_seed, **(world_options or {})), model)
        self.log: list[RequestLogEntry] = []
        self.in_flight = self.max_in_flight = 0
        self._slots = asyncio.Semaphore(model.max_concurrency)

    def reset(self, latency_seed: int) -> None:
        model = replace(self.responder.model, seed=latency_seed)
        self.responder = PacedResponder(SeededWorld(seed=self.world_seed, **(self.world_options or {})), model)
        self.log = []
        self.max_in_flight = self.in_flight

    async def chat(self, request) -> object:
        from aiohttp import web

        try:
            chat = parse_chat_request(await request.read())
        except BadRequest as exc:
            return web.json_response(error_body(400, str(exc)), status=400)
        async with self._slots:
            started = time.monotonic()
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                body = await self._answer(chat)
            finally:
                self.in_flight -= 1
            self.log.append(
                RequestLogEntry(
                    role=role_of(chat),
                    n=chat.n,
                    status=200,
                    started=started,
                    ended=time.monotonic(),
                    choices=len(body["choices"]),
                )
            )
        return web.json_response(body)

    async def _answer(self, chat) -> dict:
        asked = chat if self.supports_n else replace(chat, n=1)
        if self.canned is not None:
            await asyncio.sleep(self.responder.model.first_token_s(chat))
            return completion_body(asked, [self.canned] * asked.n)
        responder = self.responder
        drawn = max(0.0, responder.latency(asked))
        await asyncio.sleep(drawn)
        responder._drawn.value = drawn  # what latency() set for this request (other requests ran meanwhile)
        model = responder.model
        responder.model = replace(model, tokens_per_s=0.0)  # the generation time is slept below, not blocking
        try:
            contents = responder(asked)
        finally:
            responder.model = model
        record = responder.records.pop()
        generation = model.generation_s(contents)
        if generation:
            await asyncio.sleep(generation)
        responder.records.append(replace(record, service_s=drawn + generation, ended=time.monotonic()))
        return completion_body(asked, contents)

    async def models(self, request) -> object:
        from aiohttp import web

        data = [{"id": m, "object": "model", "created": 0, "owned_by": "fake"} for m in self.responder.models]
        return web.json_response({"object": "list", "data": data})


def _serve(
    conn,
    model: LatencyModel,
    supports_n: bool,
    world_seed: int,
    world_options: dict | None,
    canned: str | None,
    port: int = 0,
) -> None:
    import uvloop
    from aiohttp import web

    async def main() -> None:
        app_state = AsyncLatencyApp(
            model, supports_n=supports_n, world_seed=world_seed, canned=canned, world_options=world_options
        )
        app = web.Application(client_max_size=64 * 2**20)
        app.add_routes([web.post("/v1/chat/completions", app_state.chat), web.get("/v1/models", app_state.models)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port, backlog=4096)
        await site.start()
        bound = runner.addresses[0][1]
        loop = asyncio.get_running_loop()
        if conn is None:
            print(f"serving http://127.0.0.1:{bound}/v1 with {model}", flush=True)
            await asyncio.Event().wait()
        conn.send(f"http://127.0.0.1:{bound}/v1")
        while True:
            command = await loop.run_in_executor(None, conn.recv)
            if command == "collect":
                conn.send(
                    (list(app_state.responder.records), list(app_state.log), app_state.max_in_flight, time.monotonic())
                )
            elif isinstance(command, tuple) and command[0] == "reset":
                app_state.reset(command[1])
                conn.send("ok")
            else:
                await runner.cleanup()
                conn.send("bye")
                return

    uvloop.run(main())


class AsyncLatencyServerProcess(LatencyServerProcess):
    """``with AsyncLatencyServerProcess(LatencyModel(...)) as srv: ... srv.base_url ... srv.collect()``."""

    _serve = staticmethod(_serve)

    def __init__(
        self,
        model: LatencyModel,
        *,
        supports_n: bool = False,
        world_seed: int = 0,
        world_options: dict | None = None,
        canned: str | None = None,
    ) -> None:
        super().__init__(model, supports_n=supports_n, world_seed=world_seed, world_options=world_options)
        self._args = (*self._args, canned)

    def cpu_s(self) -> float:
        """CPU seconds the server process has used so far (user + system, from /proc)."""
        fields = Path(f"/proc/{self._process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--no-n", action="store_true", help="ignore n: one choice per request")
    parser.add_argument("--canned", help="answer every request with this text")
    for name, value in asdict(LatencyModel()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    model = LatencyModel(**{k: args[k] for k in asdict(LatencyModel())})
    try:
        _serve(None, model, not args["no_n"], 0, None, args["canned"], args["port"])
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
