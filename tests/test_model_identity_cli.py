"""Issue 59 from outside, as a user meets it: real ``clgrpo`` processes against loopback OpenAI-compatible servers
that call their model by the same name, and one DuckDB file.

Two servers both serve ``local``, as llama-server's ``--alias`` would: the first answers right 20% of the time,
the second 90%, and their ``GET /v1/models`` entries state different weights (llama-server's ``meta``). The second
evaluation must draw every sample and report the second model's figure; the same server restarted on another port
draws nothing; ``--fresh`` draws everything again. A training run resumed against the other model is refused in
one ``error:`` line naming both, and continues, saying so, with ``--accept-model-change``.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from clgrpo.storage.store import Store
from clgrpo.testing.fake_openai import ChatRequest, FakeOpenAIServer, message_text
from clgrpo.testing.scripted_llm import ScriptedWorld, make_problems, write_jsonl
from tests.test_kill_points import cli_env

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
PROBLEMS, K = 40, 4
FIRST = {"meta": {"n_vocab": 151936, "n_ctx_train": 32768, "n_params": 494032768, "size": 397808896}}
SECOND = {"meta": {"n_vocab": 151936, "n_ctx_train": 32768, "n_params": 1543714304, "size": 986048768}}


class Adder:
    """A model of sums that is right ``accuracy`` of the time, the same way for the same request (seed, prompt,
    choice); it counts the samples it is asked for."""

    def __init__(self, accuracy: float) -> None:
        self.accuracy = accuracy
        self.samples = 0
        self._lock = threading.Lock()

    def __call__(self, request: ChatRequest) -> list[str]:
        question = message_text(request.messages[-1])
        a, b = (int(x) for x in re.findall(r"-?\d+", question)[-2:])
        with self._lock:
            self.samples += request.n
        replies = []
        for i in range(request.n):
            digest = hashlib.sha256(f"{request.seed}|{i}|{question}".encode()).digest()
            right = int.from_bytes(digest[:4], "big") / 2**32 < self.accuracy
            replies.append(f"Adding them: \\boxed{{{a + b if right else a + b + 1}}}")
        return replies


def write_eval_config(where: Path, server: FakeOpenAIServer, db: Path) -> Path:
    path = where / f"policy-{server.port}.yaml"
    policy = {"model": "local", "base_url": server.base_url, "api_key_env": None, "retry_base_delay_s": 0.01}
    path.write_text(yaml.safe_dump({"dataset": {"path": "unused.jsonl"}, "db_path": str(db), "policy": policy}))
    return path


def evaluate(config: Path, dataset: Path, db: Path, env: dict[str, str], *extra: str) -> tuple[float, str]:
    argv = [
        sys.executable, "-m", "application.cli", "eval", "--config", str(config), "--db", str(db),
        "--dataset", str(dataset), "--k", str(K), "--bootstrap", "200", "--library", "none", *extra,
    ]  # fmt: skip
    done = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    mean = re.search(r"^\s+none\s+([0-9.]+) \[", done.stdout, re.MULTILINE)
    assert mean is not None, done.stdout
    return float(mean.group(1)), done.stdout + done.stderr


def test_a_stored_sample_is_reused_only_for_the_model_that_drew_it(prefect_api, tmp_path):
    env = cli_env(prefect_api, tmp_path)
    problems = [
        {"id": f"q{i}", "problem": f"What is {i} + {2 * i + 3}?", "answer": str(3 * i + 3)} for i in range(PROBLEMS)
    ]
    dataset = write_jsonl(problems, tmp_path / "heldout.jsonl")
    db = tmp_path / "one.duckdb"
    first, second = Adder(0.2), Adder(0.9)

    with FakeOpenAIServer(first, models=("local",), model_info=FIRST) as server:
        port = server.port
        mean, _ = evaluate(write_eval_config(tmp_path, server, db), dataset, db, env)
    assert first.samples == PROBLEMS * K and mean < 0.4

    # the first server stopped, the second started on the same port: the same command
    with FakeOpenAIServer(second, models=("local",), model_info=SECOND, port=port) as server:
        mean, out = evaluate(write_eval_config(tmp_path, server, db), dataset, db, env)
    assert second.samples == PROBLEMS * K, out  # nothing the first model drew is read
    assert mean > 0.7, out  # the second model's figure

    # the second server restarted on another port: the same model, so nothing is drawn
    with FakeOpenAIServer(second, models=("local",), model_info=SECOND) as server:
        assert server.port != port
        config = write_eval_config(tmp_path, server, db)
        again, out = evaluate(config, dataset, db, env)
        assert second.samples == PROBLEMS * K and again == mean, out
        assert "[read back]" in out and f"read back: {PROBLEMS * K} drawn " in out and "meta.n_params=1543714304" in out

        # --fresh draws everything anew, beside what is stored
        fresh, out = evaluate(config, dataset, db, env, "--fresh")
        assert second.samples == 2 * PROBLEMS * K, out
        assert f"{PROBLEMS * K} samples, 0 read, {PROBLEMS * K} to draw" in out, out
    with Store(db, read_only=True) as store:
        evaluations = store.query("SELECT DISTINCT run_id FROM evaluations ORDER BY run_id")["run_id"].tolist()
        rows = store.query("SELECT count(*) AS n FROM eval_results WHERE drawn")["n"].iloc[0]
    assert len(evaluations) == 3 and any(e.endswith("-2") for e in evaluations)  # the fresh one beside the others
    assert rows == 3 * PROBLEMS * K  # every draw kept


def write_train_config(where: Path, server: FakeOpenAIServer, db: Path, dataset: Path) -> Path:
    path = where / "train.yaml"
    policy = {"model": "scripted", "base_url": server.base_url, "api_key_env": None, "retry_base_delay_s": 0.01}
    path.write_text(
        yaml.safe_dump(
            {
                "dataset": {"path": str(dataset)},
                "db_path": str(db),
                "policy": policy,
                "grpo": {"group_size": 2, "epochs": 1, "batch_size": 4},
                "learning": {"library_gate": {"enabled": False}},
            }
        )
    )
    return path


def train(config: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "application.cli", "train", "--config", str(config), "--run-id", "r", *extra]
    return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_a_run_resumed_against_another_model_is_refused_unless_the_user_accepts_it(prefect_api, tmp_path):
    env = cli_env(prefect_api, tmp_path)
    dataset = write_jsonl(make_problems(n_per_family=2, seed=5), tmp_path / "train.jsonl")  # 8 problems: 2 steps
    db = tmp_path / "train.duckdb"
    with FakeOpenAIServer(ScriptedWorld(seed=3), model_info=FIRST) as server:
        port = server.port
        started = train(write_train_config(tmp_path, server, db, dataset), env, "--set", "budget.max_tokens=1")
    assert started.returncode == 3, started.stdout[-3000:] + started.stderr[-3000:]  # stopped by its budget

    world = ScriptedWorld(seed=3)
    with FakeOpenAIServer(world, model_info=SECOND, port=port) as server:
        config = write_train_config(tmp_path, server, db, dataset)
        refused = train(config, env)
        assert refused.returncode == 2
        errors = [line for line in refused.stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and errors[0].startswith("error: run 'r' was trained with the policy model"), errors
        assert "meta.n_params=494032768" in errors[0] and "meta.n_params=1543714304" in errors[0]
        assert not server.stats.chat_requests  # refused before any request

        accepted = train(config, env, "--accept-model-change")
        assert accepted.returncode == 0, accepted.stdout[-3000:] + accepted.stderr[-3000:]
        assert "continuing with the new one as asked (--accept-model-change)" in accepted.stdout
        assert server.stats.by_role["policy"] > 0
    with Store(db, read_only=True) as store:
        assert store.steps_done("r") == 2
        bound = store.run_identity("r")
    assert bound is not None and bound.fields == SECOND
