"""Loading a config (the run config, or another typed config such as the refresh's) from YAML with
``key.path=value`` overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar, overload

import yaml
from pydantic import BaseModel, ValidationError

from schemas.config import RunConfig


class ConfigError(ValueError):
    pass


ConfigModel = TypeVar("ConfigModel", bound=BaseModel)


def apply_override(tree: dict[str, Any], assignment: str) -> None:
    """``grpo.group_size=8`` -> tree["grpo"]["group_size"] = 8 (the value is parsed as YAML)."""
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} must look like key.path=value")
    path, raw = assignment.split("=", 1)
    keys = [k for k in path.strip().split(".") if k]
    if not keys:
        raise ConfigError(f"override {assignment!r} has an empty key")
    node = tree
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {assignment!r}: {key!r} is not a section")
        node = child
    node[keys[-1]] = yaml.safe_load(raw) if raw.strip() else None


@overload
def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig: ...


@overload
def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, *, model: type[ConfigModel]
) -> ConfigModel: ...


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, model: type[BaseModel] = RunConfig
) -> BaseModel:
    """The config at ``path`` (empty when None) with ``overrides`` applied, validated as ``model`` (the run
    config unless told)."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ConfigError(f"{path}: no such config file") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: invalid YAML: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the config must be a mapping")
        tree = loaded
    for assignment in overrides or []:
        apply_override(tree, assignment)
    try:
        return model.model_validate(tree)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(root)'}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{path or 'config'}: {problems}") from exc
