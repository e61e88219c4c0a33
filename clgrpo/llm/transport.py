"""The HTTP transport of the OpenAI-compatible backend: one pooled aiohttp session per backend and event loop.

A transport POSTs a JSON body to a path under the endpoint's base URL and returns the status, headers and raw
body. It raises ``TransientLLMError`` for connection failures; it does no retries and no status handling (the
backend classifies statuses, the client retries and times calls out). aiohttp because at concurrency 256-1024
it costs about a tenth of the CPU per request of the openai SDK on httpx (whose connection pool scans all its
connections and queued requests on every request): ``benchmarks/client_cpu.py``, REPORT.md "Client CPU".
"""

from __future__ import annotations

from typing import Any, Protocol

import aiohttp  # at import, not on the first call's critical path (~0.15 s)
import orjson  # ~5x faster than json both ways

from clgrpo.llm.errors import TransientLLMError


def dumps(value: Any) -> bytes:
    return orjson.dumps(value)


def loads(data: bytes | str) -> Any:
    return orjson.loads(data)


def dumps_text(value: Any) -> str:
    return dumps(value).decode("utf-8")


USER_AGENT = "clgrpo (OpenAI-compatible chat completions)"


class Transport(Protocol):
    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any, bytes]: ...

    async def aclose(self) -> None: ...


def _headers(api_key: str) -> dict[str, str]:
    return {
        "Authorization": f"Bearer {api_key}",
        "Content-Type": "application/json",
        "Accept": "application/json",
        "User-Agent": USER_AGENT,
    }


def _connection_error(base_url: str, exc: BaseException) -> Exception:
    detail = str(exc).replace("\n", " ")[:200] or type(exc).__name__
    return TransientLLMError(f"connection error at {base_url}: {type(exc).__name__}: {detail}")


class AiohttpTransport:
    """aiohttp with an unlimited connector (the client's semaphore is the only concurrency limit), keep-alive,
    and no timeout of its own beyond ``timeout_s`` (the client bounds each call with the same limit)."""

    def __init__(self, base_url: str, api_key: str, timeout_s: float) -> None:
        self.base_url = base_url
        self._headers = _headers(api_key)
        self._timeout_s = timeout_s
        self._session: Any = None

    def _open(self) -> Any:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, enable_cleanup_closed=False)
        self._session = aiohttp.ClientSession(
            connector=connector, headers=self._headers, timeout=aiohttp.ClientTimeout(total=self._timeout_s)
        )
        return self._session

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any, bytes]:
        session = self._session or self._open()
        try:
            async with session.post(self.base_url + path, data=dumps(body)) as response:
                return response.status, response.headers, await response.read()
        except (aiohttp.ClientError, OSError) as exc:
            raise _connection_error(self.base_url, exc) from exc

    async def aclose(self) -> None:
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    def __del__(self) -> None:
        # a loop that ended without aclose(): release the sockets quietly (aiohttp would log an error per object)
        session = self._session
        if session is not None and not session.closed:
            connector = session.connector
            session._connector = None
            if connector is not None:
                try:
                    connector._close()
                except Exception:  # noqa: BLE001 - best effort at teardown; the loop may be gone
                    pass


def make_transport(base_url: str, api_key: str, timeout_s: float) -> Transport:
    return AiohttpTransport(base_url, api_key, timeout_s)
