"""Domains are found through the entry point group ``clgrpo.domains`` (domains/registry.py): ours as
pyproject.toml declares them, and a third party's domain that only its own package's metadata declares, with
no edit to this project; an unknown name is one line listing the installed domains."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from application.cli import main
from domains import DomainSettingsError, UnknownDomainError, domain_for, get_domain, installed_domains, registry
from domains.math import MathDomain
from domains.web import WebDomain
from schemas.config import DomainSettings, RunConfig

ROOT = Path(__file__).resolve().parents[1]

CHESS_MODULE = '''
from schemas.config import DomainSettings


class ChessSettings(DomainSettings):
    """The chess domain's own settings: ``domain_settings`` of a run with ``domain: chess``."""

    board: int = 8


class ChessDomain:
    """A domain this project has never heard of: its loader says that it ran, with its settings."""

    name = "chess"
    settings_model = ChessSettings

    def load_dataset(self, cfg):
        size = self.settings.board
        raise ValueError(f"the chess domain ({size}x{size} board) was asked for {cfg.path}")
'''


def install_chess(where: Path) -> Path:
    """What installing a package that declares a chess domain leaves on sys.path: its module and its metadata
    (a ``*.dist-info`` whose ``entry_points.txt`` names the factory)."""
    where.mkdir(parents=True, exist_ok=True)
    (where / "chess_domain.py").write_text(CHESS_MODULE)
    info = where / "chess_domain-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: chess-domain\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[clgrpo.domains]\nchess = chess_domain:ChessDomain\n")
    return where


@pytest.fixture
def fresh_registry(monkeypatch):
    """Only installed plug-ins (an earlier test may have registered its own in this process); what a test
    registers or loads is forgotten after it."""
    monkeypatch.setattr(registry, "_REGISTRY", {})
    yield
    sys.modules.pop("chess_domain", None)


def write_config(tmp_path: Path, domain: str, **more) -> Path:
    path = tmp_path / "run.yaml"
    policy = {"model": "scripted", "base_url": "http://127.0.0.1:9/v1", "api_key_env": None}
    run = {"domain": domain, "dataset": {"path": str(tmp_path / "games.jsonl")}, "policy": policy, **more}
    path.write_text(yaml.safe_dump(run | {"db_path": str(tmp_path / "r.duckdb")}))
    return path


def test_our_domains_are_declared_as_entry_points():
    declared = {point.name: point.value for point in entry_points(group=registry.ENTRY_POINT_GROUP)}
    assert declared["math"] == "domains.math:MathDomain" and declared["web"] == "domains.web:WebDomain"
    assert isinstance(get_domain("math"), MathDomain) and isinstance(get_domain("web"), WebDomain)


def test_a_domain_declared_only_by_its_package_metadata_is_found(tmp_path, monkeypatch, fresh_registry):
    monkeypatch.syspath_prepend(str(install_chess(tmp_path / "site")))
    assert {"chess", "math", "web"} <= set(installed_domains())
    domain = get_domain("chess")
    assert type(domain).__name__ == "ChessDomain" and domain.name == "chess"


def test_a_registered_factory_wins_over_an_installed_one(fresh_registry):
    class StandIn(MathDomain):
        pass

    registry.register_domain("math", StandIn)
    assert isinstance(get_domain("math"), StandIn)


def test_an_unknown_domain_is_one_line_naming_the_installed_ones(capsys, tmp_path, fresh_registry):
    with pytest.raises(UnknownDomainError) as caught:
        get_domain("go")
    assert str(caught.value) == (
        "unknown domain 'go'; installed domains: math, web "
        "(a domain package declares its factory in the entry point group 'clgrpo.domains')"
    )
    assert main(["train", "--config", str(write_config(tmp_path, "go"))]) == 1
    lines = capsys.readouterr().err.strip().splitlines()  # (an earlier test's log may be named as the details)
    assert len(lines) == 1 and lines[0].startswith(f"error: UnknownDomainError: {caught.value}")


def test_a_real_clgrpo_process_runs_a_third_party_domain(tmp_path):
    """The console entry point in its own process, the plug-in on its PYTHONPATH: the preflight reads the
    dataset through the chess domain's loader, whose error is the command's one line."""
    site = install_chess(tmp_path / "site")
    proc = subprocess.run(
        [sys.executable, "-m", "application.cli", "train", "--config", str(write_config(tmp_path, "chess"))],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: dataset: the chess domain (8x8 board) was asked for {tmp_path / 'games.jsonl'}"
    ]


# --- a domain's own settings --------------------------------------------------------------------------------------
def run_chess(tmp_path: Path, **more) -> subprocess.CompletedProcess:
    site = install_chess(tmp_path / "site")
    return subprocess.run(
        [sys.executable, "-m", "application.cli", "train", "--config", str(write_config(tmp_path, "chess", **more))],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])},
    )


def test_a_third_party_domain_declares_its_settings_and_gets_them(tmp_path):
    """The chess package declares ``ChessSettings``; the run config's ``domain_settings`` are validated by it (one
    line naming the field when wrong) and reach the domain; nothing in this project names chess."""
    ran = run_chess(tmp_path, domain_settings={"board": 9})
    assert ran.stderr.strip().splitlines() == [
        f"error: dataset: the chess domain (9x9 board) was asked for {tmp_path / 'games.jsonl'}"
    ]
    wrong = run_chess(tmp_path / "wrong", domain_settings={"board": "big", "clock": 5})
    (line,) = wrong.stderr.strip().splitlines()
    assert wrong.returncode == 2 and line.startswith("error: ") and "domain_settings (chess domain): board: " in line
    assert "clock: Extra inputs are not permitted" in line, line


class Go(MathDomain):
    """A domain registered in this process, with settings of its own."""

    class Settings(DomainSettings):
        komi: float = 6.5

    settings_model = Settings


def test_settings_enter_the_fingerprint_only_when_changed_and_are_refused_for_a_domain_without(fresh_registry):
    registry.register_domain("go", Go)
    base = {"domain": "go", "dataset": {"path": "games.jsonl"}}
    plain, defaults = RunConfig(**base), RunConfig(**base, domain_settings={"komi": 6.5})
    assert plain.fingerprint() == defaults.fingerprint() != RunConfig(**base, domain_settings={"komi": 7}).fingerprint()
    assert domain_for(RunConfig(**base, domain_settings={"komi": 7})).settings == Go.Settings(komi=7)
    assert domain_for(plain).settings == Go.Settings()
    on_math = RunConfig(dataset=base["dataset"], domain_settings={"komi": 7})  # kept as given: read where resolved
    with pytest.raises(DomainSettingsError, match="domain_settings: the domain 'math' declares no settings of its"):
        domain_for(on_math)


SCHEMAS_ALONE = """
import importlib.metadata, pkgutil, sys

import schemas

entry_points = importlib.metadata.entry_points


def refuse_domains(**selection):
    assert selection.get("group") != "clgrpo.domains", "the schemas looked for a domain plug-in"
    return entry_points(**selection)  # pydantic's own plug-ins


importlib.metadata.entry_points = refuse_domains
for module in pkgutil.iter_modules(schemas.__path__):
    __import__(f"schemas.{module.name}")
from schemas.config import RunConfig

plain = RunConfig(domain="web", dataset={"path": "q.jsonl"})
assert plain.fingerprint()
given = RunConfig(domain="web", dataset={"path": "q.jsonl"}, domain_settings={"search": {"top_k": 3}})
assert given.domain_settings == {"search": {"top_k": 3}}
try:
    given.fingerprint()
except ValueError as exc:
    print(exc)
print(sorted(name for name in sys.modules if name.split(".")[0] in ("domains", "tasks", "flows", "clgrpo")))
"""


def test_the_schemas_load_no_plug_in():
    """Every schemas module imported with the entry-point loader refusing: a run config without domain settings
    validates and has its fingerprint; one with them keeps them as given, and its fingerprint says that only the
    domain registry reads them; no module of ours above the schemas was imported."""
    proc = subprocess.run(
        [sys.executable, "-c", SCHEMAS_ALONE],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "domain_settings: no domain registry in this process to read the 'web' domain's settings with (import domains)",
        "[]",
    ]


def test_the_registry_reads_the_settings_of_a_domain_it_knows_without_entry_points(monkeypatch, fresh_registry):
    """The run config's ``domain_settings`` are read with the registry's own models: a domain registered in this
    process needs no entry point."""
    monkeypatch.setattr(registry, "entry_points", lambda **_: pytest.fail("looked for installed plug-ins"))
    registry.register_domain("go", Go)
    config = RunConfig(domain="go", dataset={"path": "games.jsonl"}, domain_settings={"komi": 7})
    assert domain_for(config).settings == Go.Settings(komi=7.0) and registry.settings_model("go") is Go.Settings


READ_SETTINGS = """
import sys

if sys.argv[1] == "domains":
    import domains  # noqa: F401
from schemas.config import RunConfig

config = RunConfig(domain="web", dataset={"path": "q.jsonl"}, domain_settings={"search": {"top_k": 99}, "opne": {}})
print(config.domain_settings)
from domains import domain_for

for read in (lambda: domain_for(config), config.fingerprint):
    try:
        read()
    except ValueError as exc:
        print(type(exc).__name__, exc)
"""


def test_domain_settings_are_read_where_the_domain_is_resolved_whatever_was_imported_first():
    """A run config keeps its domain settings as given; the domain, once resolved, and the fingerprint read them
    with the model the domain declares: the same error naming each wrong key or value, whether the domain
    registry was imported before the config was validated or only after."""
    outputs = []
    for first in ("schemas", "domains"):
        proc = subprocess.run(
            [sys.executable, "-c", READ_SETTINGS, first],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout.splitlines())
    assert outputs[0] == outputs[1]
    wrong = "domain_settings (web domain): search.top_k: Input should be less than or equal to 50; opne: Extra inputs"
    given, resolved, fingerprinted = outputs[0]
    assert given == "{'search': {'top_k': 99}, 'opne': {}}"
    assert resolved.startswith(f"DomainSettingsError {wrong}") and fingerprinted.startswith(f"ValueError {wrong}")


def test_the_web_settings_old_place_is_read_with_the_same_fingerprint():
    web = {"search": {"index": "site", "base_url": "http://127.0.0.1:8765"}, "open": {"allow_hosts": ["127.0.0.1"]}}
    base = {"domain": "web", "dataset": {"path": "q.jsonl"}}
    old = RunConfig(**base, rollout={"mode": "agent", "agent": {"max_turns": 8, "web": web}})
    new = RunConfig(**base, rollout={"mode": "agent", "agent": {"max_turns": 8}}, domain_settings=web)
    assert old == new and old.fingerprint() == new.fingerprint()
    assert domain_for(new).settings.open.allow_hosts == ["127.0.0.1"]
    direct = RunConfig(**base, domain_settings=web)  # the tools are not used: as before, not in the fingerprint
    assert direct.fingerprint() == RunConfig(**base).fingerprint()
    with pytest.raises(ValidationError, match="rollout.agent.web and domain_settings are both set"):
        RunConfig(**base, rollout={"agent": {"web": web}}, domain_settings=web)
