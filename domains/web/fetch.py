"""``open(url)`` for the web domain: a careful HTTP(S) fetch and HTML turned into readable text with its links.

Safety rules (each refusal is one line the agent sees as its tool error; nothing is fetched):
- only ``http`` and ``https`` URLs, without credentials in them (``user:pass@``);
- the host must resolve to public addresses only: loopback, private, link-local, multicast, reserved and
  unspecified addresses are refused unless the host (``host`` or ``host:port``) or the address (an IP or CIDR)
  is in ``open.allow_hosts`` (tests serve their site on 127.0.0.1 that way); every redirect hop is checked again;
- at most ``open.max_redirects`` redirects, ``open.max_bytes`` of body (the rest is cut and marked), the
  ``open.timeout_s`` limit for the whole fetch;
- no cookies and no credentials are ever sent (a fresh client per fetch, its cookie jar cleared after every
  response, no auth); the user agent names clgrpo, and ``robots.txt`` is obeyed for it (RFC 9309: a missing
  robots.txt allows all, a server error or an unreachable one disallows).
Known limit: the address check resolves the name before the client connects; a resolver that answers
differently the second time (DNS rebinding) is not caught.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Iterable
from urllib.parse import urljoin, urlsplit
from urllib.robotparser import RobotFileParser

import httpx

from domains.web.extract import html_to_page
from domains.web.page import Page
from domains.web.settings import OpenConfig

TEXT_TYPES = ("text/html", "application/xhtml+xml", "text/plain")
_ROBOTS_TTL_S = 600.0
_ROBOTS_MAX_BYTES = 500_000


class FetchRefused(ValueError):
    """A URL the safety rules refuse, or a page that could not be fetched: one line for the agent."""


# --- the address rules ---------------------------------------------------------------------------------------
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def _allowed(host: str, port: int, address: IPAddress, allow: Iterable[str]) -> bool:
    for entry in allow:
        entry = entry.strip().lower()
        if entry in (host.lower(), f"{host.lower()}:{port}"):
            return True
        try:
            if address in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue
    return False


def _is_public(address: IPAddress) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return not (
        address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
        or address.is_unspecified
    )


async def check_url(url: str, settings: OpenConfig) -> tuple[str, int]:
    """Refuse what the rules refuse (``FetchRefused``); else the host and port."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise FetchRefused(
            f"refused {url!r}: only http and https URLs can be opened (not {parts.scheme or 'a path'!r})"
        )
    if parts.username or parts.password:
        raise FetchRefused(f"refused {url!r}: URLs with credentials are not opened")
    host = parts.hostname
    if not host:
        raise FetchRefused(f"refused {url!r}: no host")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise FetchRefused(f"cannot open {url}: host {host!r} does not resolve ({exc})") from exc
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%")[0])  # an IPv6 address may end in %zone
        if not _is_public(address) and not _allowed(host, port, address, settings.allow_hosts):
            raise FetchRefused(
                f"refused {url!r}: {host} resolves to a non-public address ({address}); only "
                f"hosts in open.allow_hosts may"
            )
    return host, port


# --- fetching ------------------------------------------------------------------------------------------------
async def _get(
    client: httpx.AsyncClient, url: str, settings: OpenConfig, max_bytes: int
) -> tuple[httpx.Response, bytes, bool]:
    """One GET, body capped at ``max_bytes``; redirects are the caller's (each hop is checked)."""
    await check_url(url, settings)
    request = client.build_request("GET", url)
    response = await client.send(request, stream=True, follow_redirects=False)
    try:
        body, truncated = bytearray(), False
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > max_bytes:
                body, truncated = body[:max_bytes], True
                break
    finally:
        await response.aclose()
        client.cookies.clear()  # nothing a server sets is ever sent back
    return response, bytes(body), truncated


async def _follow(
    client: httpx.AsyncClient, url: str, settings: OpenConfig, max_bytes: int
) -> tuple[str, httpx.Response, bytes, bool]:
    for _ in range(settings.max_redirects + 1):
        response, body, truncated = await _get(client, url, settings, max_bytes)
        location = response.headers.get("location")
        if response.is_redirect and location:
            url = urljoin(url, location)
            continue
        return url, response, body, truncated
    raise FetchRefused(f"cannot open {url}: more than {settings.max_redirects} redirects (open.max_redirects)")


def _client(settings: OpenConfig, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    timeout = httpx.Timeout(settings.timeout_s, connect=min(settings.timeout_s, 5.0))
    return httpx.AsyncClient(
        headers={"User-Agent": settings.user_agent, "Accept": "text/html, text/plain;q=0.9"},
        timeout=timeout,
        trust_env=False,
        transport=transport,
    )


# origin -> (fetched at, rules or why robots.txt could not be read: then everything is disallowed, RFC 9309)
_robots: dict[str, tuple[float, RobotFileParser | str]] = {}


async def _robots_block(client: httpx.AsyncClient, url: str, settings: OpenConfig) -> str | None:
    """Why robots.txt keeps ``url`` closed to clgrpo's user agent, or None when it may be fetched."""
    parts = urlsplit(url)
    origin = f"{parts.scheme}://{parts.netloc}"
    cached = _robots.get(origin)
    if cached is None or time.monotonic() - cached[0] > _ROBOTS_TTL_S:
        rules: RobotFileParser | str
        try:
            _, response, body, _ = await _follow(client, f"{origin}/robots.txt", settings, _ROBOTS_MAX_BYTES)
            if response.status_code >= 500:
                rules = f"robots.txt of {parts.netloc} answered HTTP {response.status_code}"
            else:
                rules = RobotFileParser()
                rules.parse(body.decode("utf-8", "replace").splitlines() if response.status_code < 400 else [])
        except (httpx.HTTPError, FetchRefused) as exc:
            rules = f"robots.txt of {parts.netloc} could not be read ({type(exc).__name__}: {exc})"
        cached = _robots[origin] = (time.monotonic(), rules)
    rules = cached[1]
    if isinstance(rules, str):
        return f"{rules}, so nothing there is fetched"
    if not rules.can_fetch(settings.user_agent, url):
        return f"robots.txt of {parts.netloc} disallows it for {settings.user_agent.split('/')[0]}"
    return None


async def fetch_page(url: str, settings: OpenConfig, transport: httpx.AsyncBaseTransport | None = None) -> Page:
    """Fetch ``url`` under the safety rules and extract it; ``FetchRefused`` with one line otherwise."""
    url = url.strip()
    await check_url(url, settings)
    try:
        async with _client(settings, transport) as client:
            return await asyncio.wait_for(_fetch(client, url, settings), settings.timeout_s)
    except asyncio.TimeoutError:
        raise FetchRefused(
            f"cannot open {url}: no complete answer within {settings.timeout_s:g} s (open.timeout_s)"
        ) from None
    except httpx.HTTPError as exc:
        raise FetchRefused(f"cannot open {url}: {type(exc).__name__}: {exc}") from exc


async def _fetch(client: httpx.AsyncClient, url: str, settings: OpenConfig) -> Page:
    if settings.respect_robots and (blocked := await _robots_block(client, url, settings)):
        raise FetchRefused(f"refused {url}: {blocked}")
    final, response, body, truncated = await _follow(client, url, settings, settings.max_bytes)
    kind = response.headers.get("content-type", "text/html").split(";")[0].strip().lower()
    if response.status_code >= 400:
        raise FetchRefused(f"cannot open {final}: HTTP {response.status_code}")
    if kind not in TEXT_TYPES:
        raise FetchRefused(f"cannot open {final}: {kind} is not a page (only HTML and plain text)")
    text = body.decode(response.encoding or "utf-8", "replace")
    if kind == "text/plain":
        return Page(final, response.status_code, "", text, [], truncated)
    return html_to_page(text, final, response.status_code, truncated)
