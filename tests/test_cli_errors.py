"""User errors end a command with one ``error:`` line naming the culprit, within seconds, before any stage (and
before Prefect starts): the preflight checks of datasets, API keys, endpoints and models."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from application.cli import main
from clgrpo.testing.fake_openai import FakeOpenAIServer
from clgrpo.testing.scripted_llm import ScriptedWorld, make_problems, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
PREFLIGHT_LIMIT_S = 10.0


@pytest.fixture
def good_dataset(tmp_path: Path) -> Path:
    return write_jsonl(make_problems(n_per_family=1), tmp_path / "good.jsonl")


def write_config(tmp_path: Path, dataset: Path, **policy: object) -> Path:
    path = tmp_path / "run.yaml"
    policy = {"model": "scripted", "base_url": "http://127.0.0.1:9/v1", "api_key_env": None, **policy}
    path.write_text(
        yaml.safe_dump({"dataset": {"path": str(dataset)}, "db_path": str(tmp_path / "r.duckdb"), "policy": policy})
    )
    return path


def one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    started = time.monotonic()
    code = main(argv)
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert elapsed < PREFLIGHT_LIMIT_S, f"{elapsed:.1f} s: {lines[0]}"
    return lines[0]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def silent_server() -> Iterator[int]:
    """Accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join(timeout=2)
    for conn in held:
        conn.close()
    listener.close()


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "dataset file not found"),
        (b"", "contains no rows"),
        (b"\xff\xfe not utf-8\n", "cannot read file"),
        (json.dumps({"id": "p1", "problem": "1+1?"}).encode() + b"\n", "field 'answer': missing column"),
        (b'{"id": "p1", "problem": "1+1?", "answer": "2"}\n{"id": "p2", "problem": ""', "row at line 2: invalid JSON"),
    ],
    ids=["missing", "empty", "not-utf8", "no-answers", "bad-row"],
)
def test_dataset_errors_name_the_file_and_row(tmp_path, capsys, content, expected):
    dataset = tmp_path / "data.jsonl"
    if content is not None:
        dataset.write_bytes(content)
    line = one_error_line(capsys, ["train", "--config", str(write_config(tmp_path, dataset))])
    assert expected in line and "data.jsonl" in line


def test_a_dead_endpoint_is_named_with_its_url(tmp_path, capsys, good_dataset):
    url = f"http://127.0.0.1:{closed_port()}/v1"
    line = one_error_line(capsys, ["train", "--config", str(write_config(tmp_path, good_dataset, base_url=url))])
    assert f"cannot reach {url}" in line and "policy/learner model 'scripted'" in line


def test_an_endpoint_that_never_answers_fails_within_the_limit(tmp_path, capsys, good_dataset, silent_server):
    url = f"http://127.0.0.1:{silent_server}/v1"
    line = one_error_line(capsys, ["train", "--config", str(write_config(tmp_path, good_dataset, base_url=url))])
    assert f"{url} did not answer within" in line


def test_a_missing_api_key_names_its_environment_variable(tmp_path, capsys, good_dataset, monkeypatch):
    monkeypatch.delenv("CLGRPO_TEST_API_KEY", raising=False)
    config = write_config(
        tmp_path, good_dataset, base_url="https://api.example.com/v1", api_key_env="CLGRPO_TEST_API_KEY"
    )
    line = one_error_line(capsys, ["train", "--config", str(config)])
    assert "set the environment variable CLGRPO_TEST_API_KEY" in line and "https://api.example.com/v1" in line


def test_an_unknown_model_is_named_with_what_the_server_serves(tmp_path, capsys, good_dataset):
    with FakeOpenAIServer(ScriptedWorld()) as server:
        config = write_config(tmp_path, good_dataset, base_url=server.base_url, model="no-such-model")
        line = one_error_line(capsys, ["train", "--config", str(config)])
    assert "does not serve 'no-such-model' (it serves: scripted)" in line


def test_a_learner_on_another_endpoint_is_checked_too(tmp_path, capsys, good_dataset):
    with FakeOpenAIServer(ScriptedWorld()) as server:
        config = write_config(tmp_path, good_dataset, base_url=server.base_url)
        tree = yaml.safe_load(config.read_text())
        tree["learner"] = {"model": "scripted", "base_url": f"http://127.0.0.1:{closed_port()}/v1", "api_key_env": None}
        config.write_text(yaml.safe_dump(tree))
        line = one_error_line(capsys, ["train", "--config", str(config)])
    assert line.startswith("error: learner model 'scripted': cannot reach")


def test_eval_and_refresh_preflight(tmp_path, capsys, good_dataset):
    config = write_config(tmp_path, good_dataset, base_url=f"http://127.0.0.1:{closed_port()}/v1")
    line = one_error_line(
        capsys, ["eval", "--library", "none", "--dataset", str(tmp_path / "nope.jsonl"), "--config", str(config)]
    )
    assert "--dataset: dataset file not found" in line
    assert "cannot reach" in one_error_line(
        capsys, ["eval", "--library", "none", "--dataset", str(good_dataset), "--config", str(config)]
    )
    refresh = tmp_path / "refresh.yaml"
    refresh.write_text(
        yaml.safe_dump(
            {
                "source": {"path": str(tmp_path / "incoming")},
                "training": {"db_path": str(tmp_path / "r.duckdb")},
                "evaluation": {"dataset": {"path": str(good_dataset)}},
            }
        )
    )
    line = one_error_line(capsys, ["refresh", "run", "--config", str(refresh)])
    assert "source.path" in line and "no such file or directory" in line


def test_the_terminal_of_a_real_process_shows_one_line(tmp_path, good_dataset):
    """The installed entry point, as a user runs it: no traceback, one line, a non-zero exit."""
    config = write_config(tmp_path, tmp_path / "missing.jsonl")
    proc = subprocess.run(
        [sys.executable, "-m", "application.cli", "train", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [f"error: dataset: dataset file not found: {tmp_path / 'missing.jsonl'}"]


def test_hybrid_learning_refuses_an_api_policy(capsys, tmp_path, good_dataset):
    config = write_config(tmp_path, good_dataset)
    with_hybrid = yaml.safe_load(config.read_text()) | {"hybrid": {"enabled": True}}
    config.write_text(yaml.safe_dump(with_hybrid))
    line = one_error_line(capsys, ["train", "--config", str(config)])
    assert (
        line.startswith("error: hybrid.enabled: the numeric step needs a local transformers model as the policy")
        and "policy 'scripted' is backend openai at http://127.0.0.1:9/v1" in line
    )


def test_an_adapter_of_another_base_is_refused(capsys, tmp_path, good_dataset):
    # a local model is built here: a [dev] install (API models only, no torch) skips this with the reason
    pytest.importorskip("torch", reason="the local extra (torch, transformers) is not installed")
    pytest.importorskip("transformers", reason="the local extra (torch, transformers) is not installed")
    from tests.tiny_model import build_tiny_model

    model = build_tiny_model(tmp_path / "tiny")
    capsys.readouterr()  # the model build's own progress bar
    adapter = tmp_path / "adapter_step3"
    adapter.mkdir()
    for name, text in (
        ("adapter_model.safetensors", ""),
        ("adapter_config.json", "{}"),
        ("clgrpo_adapter.json", json.dumps({"base_model": "SmolLM2-135M-Instruct@0123abcd"})),
    ):
        (adapter / name).write_text(text)
    local = write_config(tmp_path, good_dataset, backend="transformers", model_path=str(model), adapter=str(adapter))
    line = one_error_line(capsys, ["eval", "--library", "none", "--dataset", str(good_dataset), "--config", str(local)])
    assert line.startswith(
        f"error: policy.adapter: adapter {adapter} was trained on base model "
        f"SmolLM2-135M-Instruct@0123abcd, but the policy is tiny@"
    ), line


def test_local_embeddings_without_torch_are_refused_before_any_stage(tmp_path, good_dataset):
    """An install without torch (``pip install -e ".[dev]"``, API models only) and a config that merges near-duplicate
    lessons with the local embedding model: refused by the preflight in one line, not at the first merge."""
    hidden = tmp_path / "no_torch"
    hidden.mkdir()
    # a None entry in sys.modules is how Python itself marks a module as absent (import and find_spec agree)
    (hidden / "sitecustomize.py").write_text(
        "import sys\nsys.modules['torch'] = None\nsys.modules['transformers'] = None\n"
    )
    config = write_config(tmp_path, good_dataset)
    tree = yaml.safe_load(config.read_text()) | {"library": {"near_duplicates": "merge"}}
    config.write_text(yaml.safe_dump(tree))
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "application.cli", "train", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(hidden)},
    )
    assert time.monotonic() - started < 60
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: library.near_duplicates merge: local embedding models need torch and transformers, not installed: "
        "pip install torch==2.13.0 && pip install 'clgrpo[local]'"
    ]


def test_a_command_gives_its_terminal_back_when_it_ends(tmp_path):
    """A command run in this process (a test, a notebook) shows Prefect's warnings on its own stderr; when it ends,
    Prefect's console writes where it wrote before, so a flow's warning after it never goes to a stream that is gone
    (it printed '--- Logging error ---' on whatever stderr was then, once the command's had been closed)."""
    import io
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    from application.terminal import Session

    before, terminal, later = io.StringIO(), io.StringIO(), io.StringIO()
    root, console = logging.getLogger(), PrefectConsoleHandler(stream=before)
    handlers, root.handlers = root.handlers, [console]  # Prefect's console alone (not the session's others)
    flow_log = logging.getLogger("flows.terminal_test")  # a warning of a flow
    stderr = sys.stderr
    try:
        sys.stderr = terminal
        with Session(tmp_path / "logs" / "command.log", bars=False):
            flow_log.warning("during the command")
        terminal.close()  # the command's terminal is gone
        sys.stderr = later
        flow_log.warning("after the command")
    finally:
        sys.stderr = stderr
        root.handlers = handlers
    assert "--- Logging error ---" not in later.getvalue()
    assert "after the command" in before.getvalue() and "during the command" not in before.getvalue()
