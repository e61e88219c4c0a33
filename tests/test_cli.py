import json
import re
from pathlib import Path

import pytest
import yaml

from application.cli import main
from clgrpo.inputs.config import ConfigError, load_config
from clgrpo.testing.fake_openai import FakeOpenAIServer, Fault, role_of
from clgrpo.testing.scripted_llm import ScriptedWorld, make_problems, write_jsonl


def test_overrides_are_typed_and_nested(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"run_id": "a", "dataset": {"path": "x.jsonl"}}))
    cfg = load_config(path, ["grpo.group_size=8", "learning.use_groundtruth=false", "policy.base_url=http://h/v1"])
    assert cfg.grpo.group_size == 8 and cfg.learning.use_groundtruth is False
    assert cfg.policy.base_url == "http://h/v1"


@pytest.mark.parametrize(
    ("content", "overrides", "message"),
    [
        ("run_id: a\n", [], "dataset: Field required"),
        ("run_id: a\ndataset: {path: x}\ngrpo: {group_size: 0}\n", [], "grpo.group_size"),
        ("run_id: a\ndataset: {path: x}\n", ["grpo.nope=1"], "grpo.nope: Extra inputs are not permitted"),
        ("- a list\n", [], "the config must be a mapping"),
        ("run_id: a\ndataset: {path: x}\n", ["noequals"], "must look like key.path=value"),
    ],
)
def test_config_errors_name_the_field(tmp_path, content, overrides, message):
    path = tmp_path / "c.yaml"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(path, overrides)


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
def test_train_then_inspect_from_the_command_line(tmp_path, capsys):
    dataset = write_jsonl(make_problems(n_per_family=2, seed=5), tmp_path / "train.jsonl")
    db = tmp_path / "cli.duckdb"
    with FakeOpenAIServer(ScriptedWorld(seed=2)) as server:
        config = tmp_path / "run.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "run_id": "cli-run",
                    "dataset": {"path": str(dataset)},
                    # max_tokens: the gate's requests go out only if their most fits the checks budget, and this
                    # toy step's own tokens (the scripted world's replies are words) leave room for 256, not 2048
                    "policy": {
                        "model": "scripted",
                        "base_url": server.base_url,
                        "api_key_env": None,
                        "max_tokens": 256,
                    },
                    "grpo": {"group_size": 4, "epochs": 2, "batch_size": 8},
                    "concurrency": 8,
                }
            )
        )
        assert main(["train", "--config", str(config), "--db", str(db), "--set", "learning.max_words=40"]) == 0
    out = capsys.readouterr().out
    assert "run cli-run: 2 steps" in out and "DuckDB:" in out

    assert main(["runs", "list", "--db", str(db)]) == 0
    assert "cli-run" in capsys.readouterr().out
    assert main(["library", "show", "cli-run", "--db", str(db)]) == 0
    shown = capsys.readouterr().out
    assert "version 2" in shown and "[E0]" in shown
    assert main(["library", "diff", "cli-run:0", "cli-run:latest", "--db", str(db)]) == 0
    assert "+ [E0]" in capsys.readouterr().out
    out_file = tmp_path / "lib.json"
    assert main(["library", "export", "cli-run:1", "--format", "seed", "--out", str(out_file), "--db", str(db)]) == 0
    assert "E0" in json.loads(out_file.read_text())["experiences"]

    assert main(["library", "show", "nope", "--db", str(db)]) == 2
    assert "run 'nope' has no saved library" in capsys.readouterr().err

    # the database of the last run is found without --db
    assert main(["runs", "list"]) == 0
    listed = capsys.readouterr().out
    assert str(db) in listed and "cli-run" in listed and "completed" in listed
    assert main(["library", "ops", "cli-run"]) == 0
    ops = capsys.readouterr().out
    assert "# run cli-run, 2 step(s) done:" in ops and "step 1 #0 applied  add" in ops
    assert main(["library", "ops", "cli-run:2", "--rejected"]) == 0
    assert "step 1" not in capsys.readouterr().out
    assert main(["runs", "delete", "cli-run", "--yes"]) == 0
    assert "deleted run cli-run" in capsys.readouterr().out
    assert main(["runs", "list", "--db", str(db)]) == 0
    assert "no runs in" in capsys.readouterr().out


@pytest.mark.usefixtures("prefect_harness")
def test_a_run_without_summaries_and_an_eval_with_another_config(tmp_path, capsys, monkeypatch):
    """A run like the demo's (no summaries): ``library show`` says usefulness is not measured rather than "never
    cited" everywhere. An evaluation with ``--config`` whose db_path is another file finds the run in the database
    that holds it (the README's follow-up to the demo); a wrong ``--db`` is one line and leaves no empty file."""
    monkeypatch.chdir(tmp_path)
    dataset = write_jsonl(make_problems(n_per_family=2, seed=5), tmp_path / "train.jsonl")
    heldout = write_jsonl(make_problems(n_per_family=1, seed=9), tmp_path / "heldout.jsonl")
    db = tmp_path / "demo" / "clgrpo.duckdb"
    with FakeOpenAIServer(ScriptedWorld(seed=2)) as server:
        settings = {
            "dataset": {"path": str(dataset)},
            "policy": {"model": "scripted", "base_url": server.base_url, "api_key_env": None},
            "grpo": {"group_size": 4, "epochs": 1, "batch_size": 8},
            # no checks budget: this toy step's own tokens (4 problems learned from) are less than one of the
            # gate's requests could cost at most, so a strict budget would leave the gate nothing to measure
            "learning": {"summarize": False, "max_words": 40, "checks_budget": None},
        }
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump({**settings, "run_id": "nosum", "db_path": str(db)}))
        assert main(["train", "--config", str(config)]) == 0
        capsys.readouterr()
        assert main(["library", "show", "nosum"]) == 0
        shown = capsys.readouterr().out
        assert "# usefulness not measured in this configuration (learning.summarize is off" in shown
        assert "never cited" not in shown and "[E0]" in shown

        other = tmp_path / "local.yaml"  # a config whose database is elsewhere (configs/qwen-local.yaml's case)
        other.write_text(yaml.safe_dump({**settings, "db_path": "runs/clgrpo.duckdb"}))
        argv = ["eval", "--library", "none", "--compare", "nosum:latest", "--dataset", str(heldout), "--k", "1"]
        assert main([*argv, "--config", str(other), "--eval-id", "e1"]) == 0
        printed = capsys.readouterr().out
        assert f"DuckDB: {db} (tables evaluations" in printed and "4 problems from" in printed
        assert ", 1 sample each at temperature" in printed
        assert not (tmp_path / "runs").exists()  # read from (and written to) the demo's database only

        wrong = tmp_path / "wrong.duckdb"
        assert main([*argv, "--config", str(other), "--db", str(wrong)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [
            f"error: nosum:latest: {wrong} holds no run 'nosum' (clgrpo runs list shows the runs of the recent "
            "databases; --db names the one to read)"
        ]
        assert not wrong.exists()


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("clgrpo ")


@pytest.mark.flow
@pytest.mark.usefixtures("prefect_harness")
def test_a_failed_first_step_can_be_rerun_with_a_fixed_config_and_an_id_is_generated(tmp_path, capsys):
    dataset = write_jsonl(make_problems(n_per_family=1, seed=6), tmp_path / "train.jsonl")
    db = tmp_path / "runs.duckdb"
    config = tmp_path / "mine.yaml"
    with FakeOpenAIServer(ScriptedWorld(seed=4)) as server:
        server.inject(Fault(kind="status", status=400, times=1_000_000, match=lambda r: role_of(r) == "policy"))
        config.write_text(
            yaml.safe_dump(
                {
                    "dataset": {"path": str(dataset)},
                    "db_path": str(db),
                    "policy": {"model": "scripted", "base_url": server.base_url, "api_key_env": None},
                    "grpo": {"group_size": 2, "epochs": 1, "batch_size": 4},
                }
            )
        )
        assert main(["train", "--config", str(config)]) == 1
    captured = capsys.readouterr()
    run_id = re.search(r"^run (mine-\d{8}-\d{6}) \(resume it with --run-id", captured.out, re.MULTILINE).group(1)
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "all 4 policy calls failed" in errors[0] and "HTTP 400" in errors[0]
    assert "Traceback" not in captured.err
    log = Path(re.search(r"\(details: (.+)\)$", errors[0]).group(1))
    assert log.is_file() and "Traceback" in log.read_text()
    assert main(["runs", "list"]) == 0
    listed = capsys.readouterr().out
    assert re.search(rf"{run_id}\s+failed\s+0", listed) and "all 4 policy calls failed" in listed

    with FakeOpenAIServer(ScriptedWorld(seed=4)) as fixed:  # another endpoint: a changed config, same run id
        assert (
            main(["train", "--config", str(config), "--run-id", run_id, "--set", f"policy.base_url={fixed.base_url}"])
            == 0
        )
    out = capsys.readouterr().out
    assert f"run {run_id}: 1 steps" in out and f"next: clgrpo report {run_id}" in out


def test_a_reader_that_goes_away_is_not_an_error(tmp_path):
    """``clgrpo library show RUN | head -1``: the closed pipe ends the command quietly, exit 0."""
    import subprocess
    import sys

    from clgrpo.experience.library import ExperienceLibrary
    from clgrpo.storage.store import Store

    db = tmp_path / "runs.duckdb"
    with Store(db) as store:
        store.save_library(
            "big",
            ExperienceLibrary.from_mapping(
                {f"E{i}": f"Lesson number {i} says to check the work twice before answering." for i in range(3000)}
            ),
        )
    show = subprocess.Popen(
        [sys.executable, "-m", "application.cli", "library", "show", "big", "--db", str(db)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    first = show.stdout.readline()
    show.stdout.close()  # the reader goes away while the command still writes
    _, err = show.communicate(timeout=60)
    assert first.startswith(b"# run big") and show.returncode == 0 and b"error" not in err, err


def test_runs_list_on_a_fresh_install_says_there_are_no_runs_yet(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CLGRPO_STATE_DIR", str(tmp_path / "state"))  # no database remembered
    monkeypatch.chdir(tmp_path)
    assert main(["runs", "list"]) == 0
    assert "no runs yet" in capsys.readouterr().out
    # a database named explicitly must exist: one error line naming it
    assert main(["runs", "list", "--db", str(tmp_path / "typo.duckdb")]) == 2
    assert "typo.duckdb: no such DuckDB file" in capsys.readouterr().err
