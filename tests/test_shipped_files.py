"""The configs and deployments that ship with the project are valid for the flows they feed."""

import importlib
import inspect
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import TypeAdapter

from clgrpo.config import load_config
from schemas.config import RefreshConfig, RunConfig

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
        required = [p.name for p in inspect.signature(flow.fn).parameters.values()
                    if p.default is inspect.Parameter.empty]
        if name != "rollout-gpu":  # started by train with its parameters, never by hand
            assert set(required) <= set(parameters), f"{name}: no value for {set(required) - set(parameters)}"


def test_nightly_refresh_is_scheduled_and_never_overlaps():
    nightly = _deployments()["nightly-refresh"]
    assert nightly["concurrency_limit"] == 1
    (schedule,) = nightly["schedules"]
    assert schedule["cron"] == "0 2 * * *" and schedule["timezone"] == nightly["parameters"]["config"]["timezone"]
