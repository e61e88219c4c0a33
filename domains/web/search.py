"""``search(query)`` for the web domain: a local BM25 index (bm25s) over a directory of pages or a DuckDB table,
or any HTTP search API that answers JSON (configured by a URL template, a key env var and field names).

The documented adapter is SearxNG's JSON API (``/search?q={query}&format=json``: ``results[].title/url/content``);
other APIs need only the field settings, e.g. Brave Search: ``url_template:
https://api.search.brave.com/res/v1/web/search?q={query}&count={k}``, ``api_key_env: BRAVE_API_KEY``,
``api_key_header: X-Subscription-Token``, ``results_path: web.results``, ``snippet_field: description``.
"""

from __future__ import annotations

import asyncio
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote_plus

import httpx

from domains.web.settings import SearchConfig

PAGE_SUFFIXES = (".html", ".htm", ".txt", ".md")
SNIPPET_CHARS = 300


class SearchError(RuntimeError):
    """The search backend cannot work (missing index, no key, the API unreachable): one line."""


@dataclass(frozen=True)
class Hit:
    title: str
    url: str
    snippet: str


@dataclass(frozen=True)
class Document:
    url: str
    title: str
    text: str


def render_hits(query: str, hits: list[Hit]) -> str:
    if not hits:
        return f"No results for {query!r}."
    return "\n".join(f"[{i}] {h.title or '(untitled)'}\n    {h.url}\n    {h.snippet}" for i, h in enumerate(hits, 1))


# --- local index -----------------------------------------------------------------------------------------------
def documents_from_directory(folder: Path, base_url: str) -> list[Document]:
    """Every page file under ``folder``; its URL is ``base_url`` + its path relative to ``folder``."""
    from domains.web.extract import html_to_page

    docs = []
    pages = (
        p for p in folder.rglob("*") if p.suffix.lower() in PAGE_SUFFIXES and p.is_file() and p.name != "robots.txt"
    )
    for path in sorted(pages):
        url = base_url.rstrip("/") + "/" + path.relative_to(folder).as_posix()
        raw = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix.lower() in (".html", ".htm"):
            page = html_to_page(raw, url)
            docs.append(Document(url, page.title, page.text))
        else:
            docs.append(Document(url, path.stem, raw))
    return docs


def documents_from_duckdb(path: Path, table: str) -> list[Document]:
    import duckdb

    with duckdb.connect(str(path), read_only=True) as con:
        try:
            rows = con.execute(f'SELECT url, title, text FROM "{table}"').fetchall()
        except duckdb.Error as exc:
            raise SearchError(
                f"search.index {path}: table {table!r} with columns url, title, text: {str(exc).splitlines()[0]}"
            ) from exc
    return [Document(str(u), str(t or ""), str(x or "")) for u, t, x in rows]


class LocalIndex:
    """BM25 (bm25s, English stop words) over title + text of the documents."""

    def __init__(self, documents: list[Document]) -> None:
        import bm25s

        if not documents:
            raise SearchError("search.index: no documents to index")
        self.documents = documents
        self._bm25s = bm25s
        self._retriever = bm25s.BM25()
        corpus = [f"{d.title}\n{d.text}" for d in documents]
        self._retriever.index(bm25s.tokenize(corpus, stopwords="en", show_progress=False), show_progress=False)

    def search(self, query: str, k: int) -> list[Hit]:
        tokens = self._bm25s.tokenize([query], stopwords="en", show_progress=False)
        k = min(k, len(self.documents))
        if not tokens.vocab:  # only stop words
            return []
        indices, scores = self._retriever.retrieve(tokens, k=k, show_progress=False)
        hits = []
        for index, score in zip(indices[0], scores[0]):
            if score <= 0:
                continue
            doc = self.documents[int(index)]
            hits.append(Hit(doc.title, doc.url, " ".join(doc.text.split())[:SNIPPET_CHARS]))
        return hits


_indexes: dict[tuple[str, str | None, str], LocalIndex] = {}
_lock = threading.Lock()


def local_index(settings: SearchConfig) -> LocalIndex:
    """The index of ``search.index``, built once per process."""
    if not settings.index:
        raise SearchError("search.backend local needs search.index (a directory of pages or a DuckDB file)")
    path = Path(settings.index).expanduser()
    key = (str(path.resolve()), settings.base_url, settings.table)
    with _lock:
        if key not in _indexes:
            if path.is_dir():
                if not settings.base_url:
                    raise SearchError(
                        f"search.index {path} is a directory: set search.base_url (the URL its files are served under)"
                    )
                _indexes[key] = LocalIndex(documents_from_directory(path, settings.base_url))
            elif path.is_file():
                _indexes[key] = LocalIndex(documents_from_duckdb(path, settings.table))
            else:
                raise SearchError(f"search.index {path}: no such directory or DuckDB file")
        return _indexes[key]


# --- an HTTP search API --------------------------------------------------------------------------------------------
def _at(payload: Any, dotted: str) -> Any:
    for part in dotted.split(".") if dotted else []:
        payload = payload.get(part) if isinstance(payload, dict) else None
    return payload


async def http_search(
    query: str, settings: SearchConfig, transport: httpx.AsyncBaseTransport | None = None
) -> list[Hit]:
    if not settings.url_template or "{query}" not in settings.url_template:
        raise SearchError("search.backend http needs search.url_template with {query}")
    headers = {"Accept": "application/json"}
    if settings.api_key_env:
        key = os.environ.get(settings.api_key_env)
        if not key:
            raise SearchError(f"search: environment variable {settings.api_key_env} (search.api_key_env) is not set")
        headers[settings.api_key_header] = (
            f"Bearer {key}" if settings.api_key_header.lower() == "authorization" else key
        )
    url = settings.url_template.replace("{query}", quote_plus(query)).replace("{k}", str(settings.top_k))
    try:
        async with httpx.AsyncClient(timeout=settings.timeout_s, trust_env=False, transport=transport) as client:
            response = await client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        raise SearchError(f"search API {url.split('?')[0]}: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise SearchError(f"search API {url.split('?')[0]}: HTTP {response.status_code}: {response.text[:200]}")
    try:
        results = _at(response.json(), settings.results_path)
    except ValueError as exc:
        raise SearchError(f"search API {url.split('?')[0]}: the reply is not JSON") from exc
    if not isinstance(results, list):
        raise SearchError(
            f"search API {url.split('?')[0]}: no list at {settings.results_path!r} in the reply (search.results_path)"
        )
    hits = []
    for item in results[: settings.top_k]:
        if isinstance(item, dict) and item.get(settings.url_field):
            hits.append(
                Hit(
                    str(item.get(settings.title_field) or ""),
                    str(item[settings.url_field]),
                    " ".join(str(item.get(settings.snippet_field) or "").split())[:SNIPPET_CHARS],
                )
            )
    return hits


async def search(query: str, settings: SearchConfig, transport: httpx.AsyncBaseTransport | None = None) -> list[Hit]:
    if settings.backend == "http":
        return await http_search(query, settings, transport)
    index = await asyncio.to_thread(local_index, settings)
    return index.search(query, settings.top_k)
