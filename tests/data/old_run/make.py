"""Writes ``old_run.duckdb`` (kept gzipped: ``gzip -9 old_run.duckdb``) and ``train.jsonl`` here: a run stored
by an earlier version of clgrpo (commit 3014907, before each table was declared once), whose first step completed
and whose second failed (its policy calls were refused), for ``tests/test_old_database.py`` to resume with the
code as it is now. Run it from the repository root of the version that writes the fixture:

    PYTHONPATH=$PWD python tests/data/old_run/make.py

It changes into this folder, so the run's paths are relative (``train.jsonl``, ``old_run.duckdb``) and the test
can resume it from a copy anywhere."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from prefect.testing.utilities import prefect_test_harness

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from tests.data.old_run.world import PROBLEMS, SECOND_STEP, config, world  # noqa: E402


async def main() -> None:
    from clgrpo.testing.fake_openai import FakeOpenAIServer
    from clgrpo.testing.scripted_llm import write_jsonl
    from flows.train import train

    os.chdir(HERE)
    for name in ("old_run.duckdb", "old_run.duckdb.wal"):
        (HERE / name).unlink(missing_ok=True)
    write_jsonl(PROBLEMS, HERE / "train.jsonl")
    with FakeOpenAIServer(world(down=SECOND_STEP)) as server:
        try:
            await train(config(server.base_url))
        except RuntimeError as exc:  # the second step fails, as meant (all its policy calls refused)
            print(f"stopped as meant: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        else:
            raise SystemExit("the second step was meant to fail")


if __name__ == "__main__":
    with prefect_test_harness(server_startup_timeout=120):
        asyncio.run(main())
