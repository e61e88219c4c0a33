"""The web domain's own settings (``domain_settings`` in a run config; before, ``rollout.agent.web``): the
``search`` and ``open`` tools' backends, limits and safety rules."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from schemas.config import Section
from schemas.domain_settings import DomainSettings


class OpenConfig(Section):
    """The web domain's ``open(url)`` tool (``domains/web/fetch.py``): its limits and safety rules."""

    timeout_s: float = Field(15.0, gt=0)  # the whole fetch, redirects and robots.txt included
    max_bytes: int = Field(2_000_000, ge=1_000)  # of a page's body; the rest is cut and marked
    max_redirects: int = Field(5, ge=0)
    respect_robots: bool = True
    user_agent: str = "clgrpo-web/0.1 (research agent; obeys robots.txt)"
    # private, loopback and other non-public addresses are refused unless listed: "host", "host:port", an IP or
    # a CIDR ("127.0.0.1", "10.0.0.0/8")
    allow_hosts: list[str] = Field(default_factory=list)
    max_links: int = Field(60, ge=0)  # links listed to the agent after a page's text


class SearchConfig(Section):
    """The web domain's ``search(query)`` tool (``domains/web/search.py``): a local index or an HTTP search API."""

    backend: Literal["local", "http"] = "local"
    # local: a directory of pages (.html/.htm/.txt/.md; a file's URL is base_url + its relative path) or a DuckDB
    # file whose ``table`` has url, title and text columns
    index: str | None = None
    base_url: str | None = None
    table: str = "documents"
    # http: a GET to url_template with {query} (URL-encoded) and {k}; the key from api_key_env goes in
    # api_key_header ("Authorization" gets "Bearer <key>"); results are read from the JSON reply at results_path
    url_template: str | None = None
    api_key_env: str | None = None
    api_key_header: str = "Authorization"
    results_path: str = "results"  # dotted path to the list of results ("web.results" for Brave)
    title_field: str = "title"
    url_field: str = "url"
    snippet_field: str = "content"  # SearxNG: content; Brave: description
    timeout_s: float = Field(15.0, gt=0)
    top_k: int = Field(5, ge=1, le=50)


class WebSettings(DomainSettings):
    """The web domain's settings (``domain_settings`` of a run with ``domain: web``): its two tools."""

    search: SearchConfig = Field(default_factory=SearchConfig)
    open: OpenConfig = Field(default_factory=OpenConfig)

    def fingerprint_into(self, payload: dict[str, Any]) -> None:
        """As when they were ``rollout.agent.web``: in the agent's settings, for agent runs (the only ones that
        use the tools), once changed from their defaults; so web runs keep their fingerprints."""
        if isinstance(payload.get("agent"), dict) and self != WebSettings():
            payload["agent"]["web"] = self.model_dump(mode="json")
