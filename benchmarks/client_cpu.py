"""CPU per LLM call of the client alone, for the HTTP stacks and process settings that could carry it.

Each variant runs in a fresh process: ``LLMClient.sample`` for ``--problems`` problems x G=5 (G separate calls,
like DeepSeek's API) at ``--concurrency``, against the asyncio latency server (its own process, one canned short
reply, latency lognormal median ``--median-s``). Measured in the client process: CPU seconds (user + system,
all threads) per call, calls per second, the server's mean requests in flight while the calls ran, and the
garbage collector's pauses (``gc.callbacks``).

Variants (``--variants``):
  sdk             the openai SDK (AsyncOpenAI, its default httpx pool: 1,000 connections, 100 kept alive)
  sdk-limits      the SDK on an httpx client whose pool keeps every connection alive
  httpx           clgrpo's backend (plain JSON body via orjson, no SDK) on httpx, pool sized to the concurrency
  aiohttp         clgrpo's backend as shipped (aiohttp)
and process settings appended with ``+``: ``+uvloop`` (uvloop's event loop), ``+gc``
(``clgrpo.process.runtime.tune_gc``: ``gc.freeze()`` after imports and a larger first-generation threshold).

    python benchmarks/client_cpu.py                                  # all variants, concurrency 256 and 1024; ~3 min
    python benchmarks/client_cpu.py --variants aiohttp+gc --concurrency 512 --problems 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(HERE), str(ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)

from gc_pauses import GCPauses  # noqa: E402

DEFAULT_VARIANTS = ["sdk", "sdk-limits", "httpx", "aiohttp", "aiohttp+gc", "aiohttp+gc+uvloop"]
LIBRARY_WORDS = 900  # a system message the size of a 30-lesson library (~1,200 tokens)


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def sdk_backend_factory(tuned_limits: bool):
    """The client's backend as it was before clgrpo's own transport: every call through the openai SDK."""
    import httpx
    import openai

    from clgrpo.llm.backends import Generation, generation

    class SDKBackend:
        def __init__(self, cfg) -> None:
            http_client = None
            if tuned_limits:
                http_client = httpx.AsyncClient(
                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)
                )
            self._client = openai.AsyncOpenAI(
                api_key="x", base_url=cfg.base_url, max_retries=0, timeout=cfg.timeout_s, http_client=http_client
            )
            self.cfg = cfg

        async def generate(self, request) -> Generation:
            response = await self._client.chat.completions.create(
                model=self.cfg.model,
                messages=request.messages,
                n=request.n,
                temperature=request.temperature,
                top_p=request.top_p,
                max_tokens=request.max_tokens,
                seed=request.seed,
            )
            # the attribute walk the old backend did, on the SDK's parsed objects
            choices = [
                {
                    "index": c.index,
                    "finish_reason": c.finish_reason,
                    "message": {"content": c.message.content, "tool_calls": None},
                }
                for c in response.choices
            ]
            usage = {
                "prompt_tokens": response.usage.prompt_tokens,
                "completion_tokens": response.usage.completion_tokens,
            }
            return generation({"choices": choices, "usage": usage}, str(self._client.base_url))

        async def aclose(self) -> None:
            await self._client.close()

    return SDKBackend


def httpx_backend_factory(concurrency: int):
    """clgrpo's backend (same body, orjson, same reply checks) on a plain httpx client sized to the concurrency."""
    import httpx

    from clgrpo.llm.backends import OpenAIBackend, TransientLLMError
    from clgrpo.llm.transport import dumps

    class HttpxTransport:
        def __init__(self, base_url: str) -> None:
            limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
            self._client = httpx.AsyncClient(
                base_url=base_url,
                limits=limits,
                timeout=httpx.Timeout(300),
                headers={"Content-Type": "application/json"},
            )

        async def post(self, path: str, body: dict):
            try:
                response = await self._client.post(path, content=dumps(body))
            except httpx.TransportError as exc:
                raise TransientLLMError(f"connection error: {exc}") from exc
            return response.status_code, response.headers, response.content

        async def aclose(self) -> None:
            await self._client.aclose()

    def make(cfg):
        backend = OpenAIBackend(cfg)
        backend._transport = HttpxTransport(backend.base_url)
        return backend

    return make


def child(variant: str, problems: int, concurrency: int, base_url: str, out: Path) -> None:
    stack, *settings = variant.split("+")
    from clgrpo.llm.client import LLMClient
    from clgrpo.process import runtime
    from schemas.config import ModelConfig

    if "gc" in settings:
        runtime.tune_gc()
    cfg = ModelConfig(
        model="bench", base_url=base_url, api_key_env=None, supports_n=False, max_tokens=256, timeout_s=300
    )
    factory = {
        "sdk": sdk_backend_factory(False),
        "sdk-limits": sdk_backend_factory(True),
        "httpx": httpx_backend_factory(concurrency),
    }.get(stack)
    client = LLMClient(cfg, concurrency=concurrency, **({"backend_factory": factory} if factory else {}))
    library = " ".join(f"lesson{i % 97}" for i in range(LIBRARY_WORDS))

    async def one(i: int) -> int:
        messages = [
            {"role": "system", "content": f"Experiences:\n{library}"},
            {"role": "user", "content": f"Problem {i}: what is {i} + {i}?"},
        ]
        sampled = await client.sample(messages, 5, stage="rollout")
        return len(sampled.failed)

    async def run() -> dict:
        await client.sample([{"role": "user", "content": "warm up"}], 5, stage="rollout")  # imports, first pool
        with GCPauses() as pauses:
            cpu0, t0 = cpu_s(), time.perf_counter()
            failed = sum(await asyncio.gather(*[one(i) for i in range(problems)]))
            wall, cpu = time.perf_counter() - t0, cpu_s() - cpu0
        await client.aclose()
        calls = problems * 5
        return {
            "variant": variant,
            "concurrency": concurrency,
            "calls": calls,
            "failed": failed,
            "wall_s": wall,
            "cpu_s": cpu,
            "cpu_ms_per_call": 1000 * cpu / calls,
            "calls_per_s": calls / wall,
            "gc_pause_s": sum(pauses.total.values()),
            "gc_gen2_pause_s": pauses.total[2],
            "gc_gen2_count": pauses.count[2],
            "gc_longest_pause_ms": 1000 * pauses.longest,
            "t0": t0,
            "t1": t0 + wall,
            "clock": time.monotonic() - time.perf_counter(),
        }

    if "uvloop" in settings:
        import uvloop

        figures = uvloop.run(run())
    else:
        figures = asyncio.run(run())
    out.write_text(json.dumps(figures))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--problems", type=int, default=1000)
    parser.add_argument("--median-s", type=float, default=0.2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        variant, problems, concurrency, base_url = args.child
        child(variant, int(problems), int(concurrency), base_url, Path(args.json))
        return
    from async_server import AsyncLatencyServerProcess
    from harness import fmt, machine, spread, table
    from latency_server import LatencyModel

    model = LatencyModel(median_s=args.median_s, sigma=0.5, tail_p=0.0, tokens_per_s=0.0, max_concurrency=4096)
    runs = []
    with AsyncLatencyServerProcess(model, canned="The answer is 42.") as server:
        for repeat in range(args.repeats):
            for concurrency in args.concurrency:
                for variant in args.variants:
                    server.reset(repeat)
                    with tempfile.NamedTemporaryFile(suffix=".json") as handle:
                        subprocess.run(
                            [
                                sys.executable,
                                __file__,
                                "--json",
                                handle.name,
                                "--child",
                                variant,
                                str(args.problems),
                                str(concurrency),
                                server.base_url,
                            ],
                            check=True,
                        )
                        figures = json.loads(Path(handle.name).read_text())
                    served = server.collect()
                    lo, hi = figures["t0"] + figures["clock"], figures["t1"] + figures["clock"]
                    figures["server_mean_in_flight"] = sum(
                        max(0.0, min(e.ended, hi) - max(e.started, lo)) for e in served.log
                    ) / (hi - lo)
                    runs.append(figures)
                    print(
                        f"{variant:>20} conc {concurrency:>4}: {figures['cpu_ms_per_call']:.2f} ms CPU/call, "
                        f"{figures['calls_per_s']:.0f} calls/s, in flight {figures['server_mean_in_flight']:.0f}, "
                        f"GC {figures['gc_pause_s']:.2f}s (gen2 {figures['gc_gen2_count']}x, "
                        f"longest {figures['gc_longest_pause_ms']:.0f} ms), failed {figures['failed']}",
                        flush=True,
                    )
    headers = [
        "variant",
        "conc",
        "CPU ms / call",
        "calls / s",
        "server mean in flight",
        "GC pauses s",
        "full GCs",
        "longest GC ms",
    ]
    rows = []
    for concurrency in args.concurrency:
        for variant in args.variants:
            group = [r for r in runs if r["variant"] == variant and r["concurrency"] == concurrency]
            pick = lambda key, group=group: fmt(spread([r[key] for r in group]), 2)  # noqa: E731
            rows.append(
                [
                    variant,
                    concurrency,
                    pick("cpu_ms_per_call"),
                    fmt(spread([r["calls_per_s"] for r in group]), 0),
                    fmt(spread([r["server_mean_in_flight"] for r in group]), 0),
                    pick("gc_pause_s"),
                    fmt(spread([r["gc_gen2_count"] for r in group]), 0),
                    pick("gc_longest_pause_ms"),
                ]
            )
    print(
        f"\n{machine()}; {args.problems} problems x G=5 calls per run, server median {args.median_s}s; "
        f"{args.repeats} run(s), median [min-max]"
    )
    print(table(headers, rows))
    if args.json:
        args.json.write_text(
            json.dumps({"machine": machine(), "args": vars(args), "runs": runs}, indent=1, default=str)
        )


if __name__ == "__main__":
    main()
