"""A self-contained web for tests and demos: a generated site of linked pages about fictional towns, served on
loopback, with questions whose answers take two or three hops from the start page.

Site (``build_site``): ``index.html`` links every town; a town page links its mayor and its river; a mayor page
states the mayor's birth year and links the mayor's home town; a river page states its length. Questions:
"In which year was the mayor of X born?" (index -> town -> mayor: answer on the 3rd page) and "How long is the
river that flows through X?" (index -> town -> river). ``robots.txt`` disallows ``/private/`` (a page there
holds a decoy). Everything is seeded: the same seed gives the same site and questions.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler
from pathlib import Path

from clgrpo.testing.loopback import LoopbackHandler, LoopbackServer

SYLLABLES = ["var", "sk", "mol", "dan", "tre", "ve", "lo", "rin", "bar", "tis", "ka", "nor", "el", "um", "pra"]
FIRST = ["Ada", "Boris", "Clara", "Dmitri", "Elin", "Farid", "Greta", "Hugo", "Ines", "Jonas", "Kira", "Lev"]


@dataclass(frozen=True)
class Town:
    slug: str
    name: str
    mayor: str
    mayor_born: int
    river: str
    river_km: int


def _name(rng: random.Random, used: set[str]) -> str:
    while True:
        name = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
        if name not in used:
            used.add(name)
            return name


def make_towns(n: int = 12, seed: int = 0) -> list[Town]:
    rng, used = random.Random(seed), set[str]()
    towns = []
    for _ in range(n):
        name = _name(rng, used)
        towns.append(
            Town(
                name.lower(),
                name,
                f"{rng.choice(FIRST)} {_name(rng, used)}",
                rng.randint(1931, 1990),
                f"{_name(rng, used)} River",
                rng.randint(40, 900),
            )
        )
    return towns


def _page(title: str, body: str) -> str:
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head><body>"
        f"<nav><a href='/index.html'>Home</a> | <a href='/about.html'>About</a></nav>"
        f"<main><h1>{title}</h1>{body}</main></body></html>"
    )


def build_site(folder: Path, towns: list[Town]) -> Path:
    """Write the site's pages into ``folder`` (served as its root)."""
    folder.mkdir(parents=True, exist_ok=True)
    items = "".join(f"<li><a href='/towns/{t.slug}.html'>{t.name}</a></li>" for t in towns)
    (folder / "index.html").write_text(
        _page(
            "Towns of the Northern Valley",
            f"<p>The valley has {len(towns)} towns. Each has its own page.</p><ul>{items}</ul>",
        )
    )
    (folder / "about.html").write_text(
        _page(
            "About this gazetteer", "<p>A gazetteer of the Northern Valley: towns, their mayors and their rivers.</p>"
        )
    )
    for sub in ("towns", "mayors", "rivers", "private"):
        (folder / sub).mkdir(exist_ok=True)
    for t in towns:
        mayor_slug, river_slug = t.mayor.lower().replace(" ", "-"), t.river.lower().replace(" ", "-")
        (folder / "towns" / f"{t.slug}.html").write_text(
            _page(
                t.name,
                (
                    f"<p>{t.name} is a town in the Northern Valley. Its mayor is <a href='/mayors/{mayor_slug}.html'>"
                    f"{t.mayor}</a>. The <a href='/rivers/{river_slug}.html'>{t.river}</a> flows through the town.</p>"
                ),
            )
        )
        (folder / "mayors" / f"{mayor_slug}.html").write_text(
            _page(
                t.mayor,
                (
                    f"<p>{t.mayor} is the mayor of <a href='/towns/{t.slug}.html'>{t.name}</a>. {t.mayor} was born in "
                    f"{t.mayor_born} and has served two terms.</p>"
                ),
            )
        )
        (folder / "rivers" / f"{river_slug}.html").write_text(
            _page(
                t.river,
                (
                    f"<p>The {t.river} flows through <a href='/towns/{t.slug}.html'>{t.name}</a>. "
                    f"It is {t.river_km} km long.</p>"
                ),
            )
        )
    (folder / "private" / "notes.html").write_text(_page("Private notes", "<p>Not for crawlers.</p>"))
    (folder / "robots.txt").write_text("User-agent: *\nDisallow: /private/\n")
    return folder


def make_questions(towns: list[Town], base_url: str) -> list[dict]:
    """Two questions per town (``id``, ``question``, ``answer``, ``root_url``, ``hops``)."""
    rows = []
    for t in towns:
        rows.append(
            {
                "id": f"born-{t.slug}",
                "question": f"In which year was the mayor of {t.name} born?",
                "answer": str(t.mayor_born),
                "root_url": f"{base_url}/index.html",
                "hops": 3,
            }
        )
        rows.append(
            {
                "id": f"river-{t.slug}",
                "question": f"How long, in km, is the river that flows through {t.name}?",
                "answer": str(t.river_km),
                "root_url": f"{base_url}/index.html",
                "hops": 3,
            }
        )
    return rows


def write_questions(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


class _Quiet(LoopbackHandler, SimpleHTTPRequestHandler):
    def do_GET(self) -> None:
        self.server.owner.requests.append({"path": self.path, "headers": dict(self.headers)})
        if self.path == "/away":  # a redirect to a private address: the hop must be checked too
            self.send_response(302)
            self.send_header("Location", "http://10.255.255.1/secret")
            self.end_headers()
            return
        if self.path.startswith("/redirect/"):  # /redirect/N -> /redirect/N-1 ... -> /index.html
            hops = int(self.path.rsplit("/", 1)[-1] or 0)
            self.send_response(302)
            self.send_header("Location", f"/redirect/{hops - 1}" if hops > 1 else "/index.html")
            self.send_header("Set-Cookie", "session=secret; Path=/")
            self.end_headers()
            return
        super().do_GET()


class SiteServer(LoopbackServer):
    """Serves ``folder`` on 127.0.0.1 (``port``; 0: a free one) in a thread, from construction on; ``requests``
    records every GET."""

    thread_name = "web-world"

    def __init__(self, folder: Path, port: int = 0) -> None:
        super().__init__(port=port)
        self.folder = folder
        self.requests: list[dict] = []
        self.start()

    def make_handler(self) -> Callable[..., BaseHTTPRequestHandler]:
        return partial(_Quiet, directory=str(self.folder))

    @property
    def base_url(self) -> str:
        return self.origin
