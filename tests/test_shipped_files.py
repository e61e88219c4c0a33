"""The configs and deployments that ship with the project are valid for the flows they feed."""

import importlib
import inspect
import re
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import TypeAdapter

from clgrpo.inputs.config import load_config
from schemas.config import RunConfig
from schemas.refresh_config import RefreshConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    model = RefreshConfig if path.name.startswith("refresh") else RunConfig
    assert isinstance(load_config(path, model=model), model)


def _deployments() -> dict[str, dict]:
    return {d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}


def test_deployment_parameters_match_their_flow_signatures():
    for name, deployment in _deployments().items():
        module, _, function = deployment["entrypoint"].partition(":")
        flow = getattr(importlib.import_module(module.removesuffix(".py").replace("/", ".")), function)
        hints = typing.get_type_hints(flow.fn)
        parameters = deployment.get("parameters", {})
        for parameter, value in parameters.items():
            TypeAdapter(hints[parameter]).validate_python(value)  # KeyError: not a parameter of the flow
        required = [
            p.name for p in inspect.signature(flow.fn).parameters.values() if p.default is inspect.Parameter.empty
        ]
        if name not in ("rollout-gpu", "numeric-update-gpu"):  # started by train with its parameters, never by hand
            assert set(required) <= set(parameters), f"{name}: no value for {set(required) - set(parameters)}"


def test_nightly_refresh_is_scheduled_and_never_overlaps():
    nightly = _deployments()["nightly-refresh"]
    assert nightly["concurrency_limit"] == 1
    (schedule,) = nightly["schedules"]
    assert schedule["cron"] == "0 2 * * *" and schedule["timezone"] == nightly["parameters"]["config"]["timezone"]


# a path in the README under one of the project's own folders, or one of its top-level files
_README_PATH = re.compile(
    r"(?<![\w./~-])((?:data|configs|tests|benchmarks|deployments|flows|tasks|domains|schemas|clgrpo"
    r"|\.ci)/[\w.*/-]*[\w*]|prefect\.yaml|pyproject\.toml)"
)


def readme_paths(text: str) -> set[str]:
    return {m.group(1) for m in _README_PATH.finditer(text)}


@pytest.mark.parametrize("page", ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md"))])
def test_every_path_the_readme_and_docs_name_exists(page):
    paths = readme_paths((ROOT / page).read_text())
    missing = sorted(p for p in paths if not list(ROOT.glob(p)))
    assert not missing, f"{page} names files that do not exist: {missing}"


def test_the_path_finder_finds_the_readmes_paths():
    paths = readme_paths((ROOT / "README.md").read_text())
    assert "benchmarks/REPORT.md" in paths and "benchmarks/learning.py" in paths  # the pattern finds paths at all


def test_readme_path_finder_catches_a_missing_file():
    assert readme_paths("run `clgrpo eval --dataset data/test.jsonl` (see data/README.md).") == {
        "data/test.jsonl",
        "data/README.md",
    }
    assert not list(ROOT.glob("data/test.jsonl"))
