"""The web domain's tools, ``search(query)`` and ``open(url)``, bound to the domain's settings
(``domain_settings.search`` and ``domain_settings.open``: ``domains/web/settings.py``)."""

from __future__ import annotations

from typing import Any

from clgrpo.prompts.web_rollout import OPEN_DESCRIPTION, SEARCH_DESCRIPTION
from domains.base import Tool, ToolContext, ToolFailure, ToolOutput
from domains.web.fetch import FetchRefused, fetch_page
from domains.web.search import SearchError, render_hits, search
from domains.web.settings import OpenConfig, SearchConfig, WebSettings
from schemas.config import AgentConfig


async def run_search(arguments: dict[str, Any], settings: SearchConfig) -> ToolOutput:
    query = arguments.get("query")
    if not isinstance(query, str) or not query.strip():
        return ToolOutput("", error="missing argument 'query' (what to search for)")
    try:
        hits = await search(query.strip(), settings)
    except SearchError as exc:  # the backend itself is broken: not the model's doing
        raise ToolFailure(f"search tool unavailable: {exc}") from exc
    return ToolOutput(render_hits(query.strip(), hits))


async def run_open(arguments: dict[str, Any], settings: OpenConfig) -> ToolOutput:
    url = arguments.get("url")
    if not isinstance(url, str) or not url.strip():
        return ToolOutput("", error="missing argument 'url' (the page to open)")
    try:
        page = await fetch_page(url, settings)
    except FetchRefused as exc:  # a refused or unreachable URL is part of the attempt: the agent sees why
        return ToolOutput("", error=str(exc))
    return ToolOutput(page.render(settings.max_links), truncated=page.truncated)


def check_search(settings: SearchConfig) -> str:
    from domains.web.search import local_index

    if settings.backend == "local":
        try:
            index = local_index(settings)
        except SearchError as exc:
            raise ToolFailure(f"search tool unavailable: {exc}") from exc
        return f"search tool: local BM25 index of {len(index.documents)} documents ({settings.index})"
    if not settings.url_template:
        raise ToolFailure("search tool unavailable: search.backend http needs search.url_template")
    return f"search tool: HTTP API {settings.url_template.split('?')[0]}"


def search_tool(settings: SearchConfig) -> Tool:
    async def run(arguments: dict[str, Any], context: ToolContext) -> ToolOutput:
        return await run_search(arguments, settings)

    def check(agent: AgentConfig) -> str:
        return check_search(settings)

    return Tool(
        name="search",
        description=SEARCH_DESCRIPTION,
        parameters={
            "type": "object",
            "properties": {"query": {"type": "string", "description": "what to search for"}},
            "required": ["query"],
            "additionalProperties": False,
        },
        run=run,
        text_argument="query",
        check=check,
    )


def open_tool(settings: OpenConfig) -> Tool:
    async def run(arguments: dict[str, Any], context: ToolContext) -> ToolOutput:
        return await run_open(arguments, settings)

    return Tool(
        name="open",
        description=OPEN_DESCRIPTION,
        parameters={
            "type": "object",
            "properties": {"url": {"type": "string", "description": "the page's URL"}},
            "required": ["url"],
            "additionalProperties": False,
        },
        run=run,
        text_argument="url",
    )


def web_tools(settings: WebSettings) -> list[Tool]:
    return [search_tool(settings.search), open_tool(settings.open)]
