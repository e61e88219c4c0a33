"""A stopped evaluation resumes from what it finished: a real `clgrpo eval` of three conditions is stopped by
SIGTERM at seeded points, then run again as its error line says; the rerun says how many samples it found, asks
the server only for the samples that were not stored, and its results equal an uninterrupted evaluation's.

What "each request once" means here: every (condition, problem, sample) whose reply was graded and stored before
a stop is never requested again; the replies a stop cut off (in flight, at most the concurrency, or answered but
not yet graded) never reached the journal, so they are asked again, and no more than them. The scripted model
answers a request with a seed the same way every time (``SeededWorld``), so the stopped-and-resumed evaluation
can be compared with the reference.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from clgrpo.experience.library import ExperienceLibrary
from clgrpo.storage.store import Store
from clgrpo.testing.fake_openai import ChatRequest, FakeOpenAIServer
from clgrpo.testing.scripted_llm import FAMILIES, make_problems, write_jsonl
from tests.test_kill_points import CONCURRENCY, SeededWorld, cli_env

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
K = 3
SEED = 42


class CountingWorld(SeededWorld):
    """Counts the policy requests per (prompt, seed): a (condition, problem, sample), since every condition's
    library makes its own prompt and sample i of a problem has seed base + i."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.sent: Counter[tuple[str, int | None]] = Counter()

    def __call__(self, request: ChatRequest):
        key = hashlib.sha256(json.dumps(request.messages, sort_keys=True).encode()).hexdigest()
        with self._lock:
            self.sent[(key, request.seed)] += 1
        return super().__call__(request)


def write_inputs(where: Path, server: FakeOpenAIServer) -> tuple[Path, Path, list[str]]:
    dataset = write_jsonl(make_problems(n_per_family=4, seed=7), where / "heldout.jsonl")  # 16 problems
    libraries = []
    for name, families in (("two", FAMILIES[:2]), ("all", FAMILIES)):
        library = ExperienceLibrary.from_mapping({f"E{i}": f.lesson for i, f in enumerate(families)})
        libraries.append(str(library.dump(where / f"{name}.json")))
    config = where / "eval.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "dataset": {"path": str(dataset)},
                "db_path": str(where / "placeholder.duckdb"),
                "policy": {
                    "model": "scripted",
                    "base_url": server.base_url,
                    "api_key_env": None,
                    "retry_base_delay_s": 0.01,
                    "retry_max_delay_s": 0.05,
                    "timeout_s": 30,
                    "supports_n": False,  # one request per sample: what a stop can cut in the middle of
                },
                "concurrency": CONCURRENCY,
            }
        )
    )
    return config, dataset, libraries


def eval_argv(config: Path, dataset: Path, libraries: list[str], db: Path) -> list[str]:
    compare = [x for lib in libraries for x in ("--compare", lib)]
    return [
        sys.executable, "-m", "application.cli", "eval", "--config", str(config), "--db", str(db),
        "--dataset", str(dataset), "--k", str(K), "--seed", str(SEED), "--eval-id", "resume-me",
        "--library", "none", *compare,
    ]  # fmt: skip


def results(db: Path) -> list[tuple]:
    with Store(db, read_only=True) as store:
        rows = store.query(
            "SELECT condition, problem_id, sample_idx, reward, extracted FROM eval_results WHERE run_id = 'resume-me' "
            "ORDER BY condition, problem_id, sample_idx"
        )
    return [tuple(r) for r in rows.itertuples(index=False)]


def settle(server: FakeOpenAIServer, timeout_s: float = 30.0) -> None:
    """Waits until the server has answered the requests a stopped process left in flight: it counts a request
    after its latency, so one sent just before the stop would otherwise land in the rerun's count."""
    deadline = time.monotonic() + timeout_s
    while server.stats.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not server.stats.in_flight, "requests still in flight 30 s after the stopped process exited"


@pytest.mark.parametrize("stops", [1, 2])
def test_a_stopped_evaluation_resumes_and_asks_only_for_what_is_missing(prefect_api, tmp_path, stops):
    world = CountingWorld(seed=11)
    with FakeOpenAIServer(world, latency=lambda _request: 0.1) as server:
        config, dataset, libraries = write_inputs(tmp_path, server)
        env = cli_env(prefect_api, tmp_path)
        reference = subprocess.run(
            eval_argv(config, dataset, libraries, tmp_path / "reference.duckdb"),
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert reference.returncode == 0, reference.stderr[-3000:]
        total = 3 * 16 * K
        assert sum(world.sent.values()) == total and len(world.sent) == total  # each request once, uninterrupted
        world.sent.clear()

        db = tmp_path / "stopped.duckdb"
        rng = random.Random(f"eval-resume:{stops}")
        targets = sorted(rng.sample(range(total // 6, total - total // 6), stops))
        lines = []
        for target in targets:
            proc = subprocess.Popen(
                eval_argv(config, dataset, libraries, db), env=env, cwd=ROOT, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            deadline = time.monotonic() + 300
            while sum(world.sent.values()) < target and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert proc.poll() is None, f"finished before the stop at {target}: {proc.stderr.read()[-2000:]}"
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
            lines.append(err)
            assert "finished work is stored" in err and "Traceback" not in err, err[-2000:]
            settle(server)
        before_rerun = sum(world.sent.values())
        asked_before = set(world.sent)
        rerun = subprocess.run(
            eval_argv(config, dataset, libraries, db), env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
        )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    found = re.search(r"resuming evaluation resume-me: (\d+) of (\d+) samples stored, (\d+) to go", rerun.stderr)
    assert found, rerun.stderr[-3000:]
    stored, expected, to_go = map(int, found.groups())
    assert expected == total and stored + to_go == total and 0 < stored < total
    asked_by_rerun = sum(world.sent.values()) - before_rerun
    assert asked_by_rerun == to_go  # only the samples that were not stored, each once
    repeated = [key for key, n in world.sent.items() if n > 1]
    assert all(key in asked_before for key in repeated)
    # asked again: only what a stop cut off, a reply in flight or one answered but not yet graded and stored
    assert len(repeated) <= stops * 2 * CONCURRENCY, (len(repeated), stops)
    assert len(world.sent) == total  # every (condition, problem, sample) was asked
    assert results(db) == results(tmp_path / "reference.duckdb")  # the same results as without the stops
