"""The web domain's tools against a generated site on loopback: ``open`` (every safety rule has a test here),
extraction with links, ``search`` over a local BM25 index and over an HTTP search API (a loopback fake)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import httpx
import pytest

from clgrpo.inputs.dataset import load_problems
from clgrpo.testing.loopback import LoopbackHandler, LoopbackServer
from clgrpo.testing.web_world import SiteServer, build_site, make_questions, make_towns, write_questions
from domains import ToolContext, ToolFailure, get_domain
from domains.web.fetch import FetchRefused, check_url, fetch_page
from domains.web.search import SearchError, http_search, local_index
from domains.web.settings import OpenConfig, SearchConfig
from domains.web.tools import open_tool, search_tool
from schemas.config import AgentConfig, DatasetConfig

TOWNS = make_towns(6, seed=3)
LOOPBACK = OpenConfig(allow_hosts=["127.0.0.1"], timeout_s=5)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    folder = build_site(tmp_path_factory.mktemp("site"), TOWNS)
    (folder / "big.html").write_text("<html><body><p>" + "word " * 5000 + "</p></body></html>")
    (folder / "paper.pdf").write_bytes(b"%PDF-1.4 not a page")
    with SiteServer(folder) as server:
        yield folder, server


# --- open: what it returns -------------------------------------------------------------------------------------
async def test_open_returns_the_text_and_every_link_of_a_page(site):
    _, server = site
    town = TOWNS[0]
    page = await fetch_page(f"{server.base_url}/towns/{town.slug}.html", LOOPBACK)
    assert page.title == town.name and "Its mayor is" in page.text and town.mayor in page.text
    urls = [link.url for link in page.links]
    mayor = f"{server.base_url}/mayors/{town.mayor.lower().replace(' ', '-')}.html"
    assert f"{server.base_url}/index.html" in urls and mayor in urls  # the navigation menu too
    rendered = page.render()
    assert rendered.startswith(f"Title: {town.name}\nURL: {server.base_url}/towns/") and f"-> {mayor}" in rendered


async def test_the_open_tool_shows_a_refusal_to_the_agent_and_the_page_otherwise(site):
    _, server = site
    context, OPEN_TOOL = ToolContext(AgentConfig()), open_tool(LOOPBACK)
    ok = await OPEN_TOOL.run({"url": f"{server.base_url}/index.html"}, context)
    assert ok.error is None and "Towns of the Northern Valley" in ok.text
    refused = await OPEN_TOOL.run({"url": "file:///etc/passwd"}, context)
    assert refused.text == "" and refused.error.startswith("refused 'file:///etc/passwd'")
    missing = await OPEN_TOOL.run({}, context)
    assert missing.error == "missing argument 'url' (the page to open)"


# --- open: the safety rules ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "url",
    [
        "file:///etc/passwd",
        "ftp://example.org/x",
        "data:text/html,hi",
        "javascript:alert(1)",
        "/etc/passwd",
        "gopher://127.0.0.1/",
    ],
)
async def test_only_http_and_https_urls_are_opened(url):
    with pytest.raises(FetchRefused, match="only http and https URLs can be opened"):
        await check_url(url, LOOPBACK)


async def test_urls_with_credentials_are_refused():
    with pytest.raises(FetchRefused, match="URLs with credentials are not opened"):
        await check_url("http://user:pass@127.0.0.1/", LOOPBACK)


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "localhost",
        "10.1.2.3",
        "192.168.0.1",
        "172.16.5.5",
        "169.254.169.254",
        "0.0.0.0",
        "[::1]",
        "[::ffff:127.0.0.1]",
        "224.0.0.1",
    ],
)
async def test_private_and_loopback_addresses_are_refused_by_default(host):
    with pytest.raises(FetchRefused, match="resolves to a non-public address"):
        await check_url(f"http://{host}/", OpenConfig())


async def test_the_allowlist_admits_exactly_what_it_names(site):
    _, server = site
    port = int(server.base_url.rsplit(":", 1)[1])
    for allow in (["127.0.0.1"], [f"127.0.0.1:{port}"], ["127.0.0.0/8"]):
        assert await check_url(f"{server.base_url}/", OpenConfig(allow_hosts=allow)) == ("127.0.0.1", port)
    with pytest.raises(FetchRefused, match="non-public"):
        await check_url(f"{server.base_url}/", OpenConfig(allow_hosts=["127.0.0.1:1", "10.0.0.0/8"]))


async def test_every_redirect_hop_is_checked_and_their_number_is_limited(site):
    _, server = site
    page = await fetch_page(f"{server.base_url}/redirect/3", LOOPBACK)
    assert page.url == f"{server.base_url}/index.html"
    with pytest.raises(FetchRefused, match=r"more than 5 redirects \(open.max_redirects\)"):
        await fetch_page(f"{server.base_url}/redirect/7", LOOPBACK)
    with pytest.raises(FetchRefused, match=r"refused 'http://10.255.255.1/secret': 10.255.255.1 resolves to a non-pub"):
        await fetch_page(f"{server.base_url}/away", LOOPBACK)


async def test_no_cookie_or_credential_is_ever_sent_and_the_user_agent_is_clgrpo(site):
    _, server = site
    start = len(server.requests)
    await fetch_page(f"{server.base_url}/redirect/3", LOOPBACK)  # every hop sets a cookie
    await fetch_page(f"{server.base_url}/index.html", LOOPBACK)
    sent = server.requests[start:]
    assert len(sent) >= 5
    assert all("Cookie" not in r["headers"] and "Authorization" not in r["headers"] for r in sent)
    assert all(r["headers"]["User-Agent"].startswith("clgrpo-web/") for r in sent)


async def test_the_body_is_cut_at_max_bytes_and_marked(site):
    _, server = site
    page = await fetch_page(f"{server.base_url}/big.html", OpenConfig(allow_hosts=["127.0.0.1"], max_bytes=1000))
    assert page.truncated and "[page cut at the size limit]" in page.render()
    assert len(page.text) < 1000


async def test_robots_txt_is_obeyed(site):
    _, server = site
    with pytest.raises(FetchRefused, match="robots.txt of 127.0.0.1:.* disallows it for clgrpo-web"):
        await fetch_page(f"{server.base_url}/private/notes.html", LOOPBACK)
    ignoring = OpenConfig(allow_hosts=["127.0.0.1"], respect_robots=False)
    assert (await fetch_page(f"{server.base_url}/private/notes.html", ignoring)).title == "Private notes"


@pytest.mark.parametrize(("status", "allowed"), [(404, True), (503, False)])
async def test_a_missing_robots_txt_allows_and_a_failing_one_disallows(status, allowed):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/robots.txt":
            return httpx.Response(status, text="")
        return httpx.Response(200, html="<html><head><title>Ok</title></head><body><p>fine</p></body></html>")

    settings = OpenConfig(allow_hosts=["127.0.0.1"])
    url = f"http://127.0.0.1:{9 if allowed else 10}/page.html"  # separate origins: robots.txt is cached per origin
    if allowed:
        assert (await fetch_page(url, settings, transport=httpx.MockTransport(handler))).title == "Ok"
    else:
        with pytest.raises(FetchRefused, match="robots.txt of 127.0.0.1:10 answered HTTP 503, so nothing there"):
            await fetch_page(url, settings, transport=httpx.MockTransport(handler))


async def test_a_server_that_never_answers_times_out():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        with pytest.raises(FetchRefused, match=r"no complete answer within 1 s \(open.timeout_s\)"):
            await fetch_page(
                f"http://127.0.0.1:{port}/", OpenConfig(allow_hosts=["127.0.0.1"], timeout_s=1, respect_robots=False)
            )
    finally:
        listener.close()


async def test_only_pages_are_opened(site):
    _, server = site
    with pytest.raises(FetchRefused, match="application/pdf is not a page"):
        await fetch_page(f"{server.base_url}/paper.pdf", LOOPBACK)
    with pytest.raises(FetchRefused, match="HTTP 404"):
        await fetch_page(f"{server.base_url}/nowhere.html", LOOPBACK)


# --- search ----------------------------------------------------------------------------------------------------
async def test_a_local_index_over_the_site_ranks_the_page_that_names_the_query(site):
    folder, server = site
    town = TOWNS[2]
    settings = SearchConfig(index=str(folder), base_url=server.base_url, top_k=3)
    context, SEARCH_TOOL = ToolContext(AgentConfig()), search_tool(settings)
    result = await SEARCH_TOOL.run({"query": f"who is the mayor of {town.name}"}, context)
    mayor = f"{server.base_url}/mayors/{town.mayor.lower().replace(' ', '-')}.html"
    top = result.text.split("\n[2] ")[0].splitlines()
    assert top[0].startswith("[1] ") and top[1].strip() in (f"{server.base_url}/towns/{town.slug}.html", mayor)
    assert (await SEARCH_TOOL.run({"query": "the of and"}, context)).text == "No results for 'the of and'."
    assert len(local_index(settings).documents) == len(list(folder.rglob("*.html")))
    broken = search_tool(SearchConfig(index=str(folder / "nope")))
    with pytest.raises(ToolFailure, match="search tool unavailable: search.index .*nope: no such directory"):
        await broken.run({"query": "x"}, context)


class _SearchApiHandler(LoopbackHandler):
    def do_GET(self):
        self.server.owner.seen.append({"path": self.path, "token": self.headers.get("X-Subscription-Token")})
        result = {"title": "Paris", "url": "https://example.org/paris", "description": "Capital of France."}
        self.send_json(200, {"web": {"results": [result]}})


class _SearchApi(LoopbackServer):
    handler_class = _SearchApiHandler

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict] = []


async def test_an_http_search_api_is_read_through_its_field_settings(monkeypatch):
    server = _SearchApi().start()
    base = server.origin
    settings = SearchConfig(
        backend="http",
        url_template=f"{base}/res/v1/web/search?q={{query}}&count={{k}}",
        api_key_env="TEST_SEARCH_KEY",
        api_key_header="X-Subscription-Token",
        results_path="web.results",
        snippet_field="description",
        top_k=3,
    )
    try:
        monkeypatch.delenv("TEST_SEARCH_KEY", raising=False)
        with pytest.raises(SearchError, match="environment variable TEST_SEARCH_KEY .* is not set"):
            await http_search("capital of france", settings)
        monkeypatch.setenv("TEST_SEARCH_KEY", "k-123")
        hits = await http_search("capital of france", settings)
        assert [(h.title, h.url, h.snippet) for h in hits] == [
            ("Paris", "https://example.org/paris", "Capital of France.")
        ]
        assert server.seen[-1] == {"path": "/res/v1/web/search?q=capital+of+france&count=3", "token": "k-123"}
        with pytest.raises(SearchError, match="no list at 'results'"):
            await http_search("x", settings.model_copy(update={"results_path": "results"}))
    finally:
        server.stop()


# --- the domain ---------------------------------------------------------------------------------------------------
def test_questions_with_a_start_page_load_and_are_graded_by_their_final_answer(tmp_path):
    rows = make_questions(TOWNS, "http://127.0.0.1:1")
    path = write_questions(rows, tmp_path / "web.jsonl")
    problems = load_problems(
        DatasetConfig(path=str(path), problem_field="question", url_field="root_url", shuffle=False)
    )
    assert problems[0].problem == f"{rows[0]['question']}\n\nStart page: http://127.0.0.1:1/index.html"
    web = get_domain("web")
    assert web.verify(f"The mayor page says so.\nFinal answer: {rows[0]['answer']}.", rows[0]["answer"]).reward == 1
    assert web.verify("Final answer: 1850", rows[0]["answer"]).reward == 0
    assert web.verify("I think it is 1850.", "1850").error == "no 'Final answer:' line"
    assert asyncio.iscoroutinefunction(web.tools()[0].run) and [t.name for t in web.tools()] == ["search", "open"]


def test_the_web_world_command_serves_the_site_and_writes_the_questions(tmp_path):
    """``clgrpo web-world``: the site and questions.jsonl on disk, served on loopback until interrupted."""
    import subprocess
    import sys

    import httpx

    with _ctrl_c_not_ignored():
        world = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "application.cli",
                "web-world",
                "--out",
                str(tmp_path),
                "--port",
                "0",
                "--towns",
                "3",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    try:
        first = world.stdout.readline()
        base = first.split("served at ")[1].strip()
        assert first.startswith(f"site: {tmp_path / 'site'} (12 pages)")
        assert "Disallow: /private/" in httpx.get(f"{base}/robots.txt", timeout=10).text
        rows = [json.loads(line) for line in (tmp_path / "questions.jsonl").read_text().splitlines()]
        assert len(rows) == 6 and all(r["root_url"] == f"{base}/index.html" for r in rows)
    finally:
        _interrupt_a_thread_other_than_main(world)
        try:
            _, err = world.communicate(timeout=30)
        finally:
            world.kill()  # a no-op once it has exited; never left running when it did not
    assert world.returncode == 0 and "Traceback" not in err, err


@contextlib.contextmanager
def _ctrl_c_not_ignored():
    """Start children as a terminal would: a test run started in the background without job control ignores
    SIGINT, and children inherit an ignored signal (Python then installs no KeyboardInterrupt handler). A handled
    signal is reset to the default at exec, so handle it here while the child starts."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _interrupt_a_thread_other_than_main(process) -> None:
    """Ctrl-C, as the kernel may deliver it: to any of the process's threads. The main thread blocked in an untimed
    ``Thread.join`` never woke when a server thread got it (the command then hung), so send it to one of those."""
    import ctypes
    import os
    import platform
    import signal

    tgkill = {"x86_64": 234, "aarch64": 131}.get(platform.machine())
    others = [int(t) for t in os.listdir(f"/proc/{process.pid}/task") if int(t) != process.pid]
    if tgkill is None or not others:
        process.send_signal(signal.SIGINT)
        return
    assert ctypes.CDLL(None, use_errno=True).syscall(tgkill, process.pid, others[0], signal.SIGINT) == 0
