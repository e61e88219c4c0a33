"""``clgrpo web-world``: the web domain's offline playground, a generated website with questions, served on
loopback."""

from __future__ import annotations

import argparse
from pathlib import Path

from application.commands.common import Command
from clgrpo.process import stopping


def cmd_web_world(args: argparse.Namespace) -> int:
    """Generate the test web (a linked site, questions, served on loopback) and serve it until interrupted."""
    from clgrpo.testing.web_world import SiteServer, build_site, make_questions, make_towns, write_questions

    out = Path(args.out)
    towns = make_towns(args.towns, seed=args.seed)
    folder = build_site(out / "site", towns)
    server = SiteServer(folder, port=args.port)
    try:  # from here on a Ctrl-C, whenever it comes, stops the site and ends the command cleanly
        questions = write_questions(make_questions(towns, server.base_url), out / "questions.jsonl")
        print(f"site: {folder} ({sum(1 for _ in folder.rglob('*.html'))} pages), served at {server.base_url}")
        print(f"questions: {questions} ({2 * len(towns)}, 3 hops each from {server.base_url}/index.html)")
        print("train on it:  clgrpo train --config configs/web.yaml      (Ctrl-C here stops the site)", flush=True)
        while server.thread.is_alive():  # timed waits: a Ctrl-C the kernel hands to a server thread instead of
            server.thread.join(0.5)  # this one is noticed here within 0.5 s (an untimed join never wakes for it)
    except (KeyboardInterrupt, stopping.Stopped):  # how a server command ends
        stopping.reset()
    finally:
        server.close()
    return 0


def _arguments(world: argparse.ArgumentParser) -> None:
    world.add_argument("--out", default="runs/web-world", help="where the site and questions.jsonl go")
    world.add_argument("--port", type=int, default=8765, help="loopback port (default 8765, as configs/web.yaml)")
    world.add_argument("--towns", type=int, default=12, help="towns in the site: 2 questions each (default 12)")
    world.add_argument("--seed", type=int, default=0)


WEB_WORLD = Command(
    "web-world",
    "generate a small linked website with questions and serve it on 127.0.0.1 (the web domain's offline playground)",
    cmd_web_world,
    _arguments,
)
