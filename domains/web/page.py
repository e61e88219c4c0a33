"""What ``open(url)`` returns: a fetched page's readable text and its links, and how the agent reads it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Link:
    text: str
    url: str


@dataclass(frozen=True)
class Page:
    url: str  # after redirects
    status: int
    title: str
    text: str  # readable text (markdown, links inline)
    links: list[Link] = field(default_factory=list)
    truncated: bool = False  # the body was cut at open.max_bytes

    def render(self, max_links: int = 60) -> str:
        """What the agent reads: title, URL, text, then the page's links numbered (so it can navigate)."""
        lines = [f"Title: {self.title or '(none)'}", f"URL: {self.url}", "", self.text.strip() or "(no text)"]
        if self.truncated:
            lines.append("[page cut at the size limit]")
        if self.links:
            lines += ["", "Links:"] + [
                f"[{i}] {link.text or '(no text)'} -> {link.url}" for i, link in enumerate(self.links[:max_links], 1)
            ]
            if len(self.links) > max_links:
                lines.append(f"... and {len(self.links) - max_links} more links")
        return "\n".join(lines)
