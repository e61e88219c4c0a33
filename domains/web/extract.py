"""HTML to readable text (trafilatura: the main content as markdown, links inline) plus every link of the page
(selectolax: navigation menus included, which main-content extraction drops and an agent needs to walk a site)."""

from __future__ import annotations

from typing import TYPE_CHECKING
from urllib.parse import urldefrag, urljoin, urlsplit

from domains.web.page import Link, Page

if TYPE_CHECKING:
    from selectolax.lexbor import LexborHTMLParser


def page_links(tree: LexborHTMLParser, base_url: str) -> list[Link]:
    """Absolute http(s) links in page order, each URL once (fragments dropped), with their anchor text."""
    seen: set[str] = set()
    links = []
    for node in tree.css("a[href]"):
        href = (node.attributes.get("href") or "").strip()
        url = urldefrag(urljoin(base_url, href))[0]
        if urlsplit(url).scheme not in ("http", "https") or url in seen:
            continue
        seen.add(url)
        links.append(Link(" ".join(node.text(separator=" ").split()), url))
    return links


def html_to_page(html: str, url: str, status: int = 200, truncated: bool = False) -> Page:
    import trafilatura
    from selectolax.lexbor import LexborHTMLParser as HTMLParser

    tree = HTMLParser(html)
    title_node = tree.css_first("title")
    title = " ".join(title_node.text().split()) if title_node else ""
    text = trafilatura.extract(
        html, url=url, include_links=True, include_tables=True, favor_recall=True, output_format="markdown"
    )
    if not text:  # a page too short or too odd for main-content extraction: all visible text
        for node in tree.css("script, style, noscript"):
            node.decompose()
        body = tree.body
        text = "\n".join(
            line.strip() for line in (body.text(separator="\n") if body else "").splitlines() if line.strip()
        )
    return Page(url, status, title, text, page_links(tree, url), truncated)
