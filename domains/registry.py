"""Finding a domain plug-in by name: an open registry.

A domain is installed, not listed here: a package declares its factory (a callable that takes no argument and
returns a ``Domain``) in the entry point group ``clgrpo.domains``, as this project does for its own two::

    [project.entry-points."clgrpo.domains"]
    math = "domains.math:MathDomain"

``get_domain(name)`` imports only the plug-in it is asked for, on first use. ``register_domain`` adds a factory
in this process only (a test's stand-in, a notebook), and wins over an installed plug-in of the same name.

A domain with settings of its own declares their model (a ``schemas.domain_settings.DomainSettings``) as its
factory's ``settings_model``: this registry is the one that finds it (and hands its lookup to the schemas on
import, for fingerprints; the schemas load no plug-in), and ``domain_for(config)`` reads the run's
``domain_settings`` with it and gives them to the domain (its ``settings`` attribute), refusing wrong ones in one
error naming each, whatever was imported first. ``domains/web`` is the worked example.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

from clgrpo.inputs.config import ConfigError
from domains.base import Domain
from schemas.config import RunConfig
from schemas.domain_settings import DomainSettings, read_domain_settings, use_domain_registry

ENTRY_POINT_GROUP = "clgrpo.domains"

_REGISTRY: dict[str, Callable[[], Domain]] = {}


class DomainSettingsError(ConfigError):
    """A run's ``domain_settings`` that its domain's settings model does not accept (each wrong key or value
    named), or settings given to a domain that declares none."""


class UnknownDomainError(KeyError):
    """No domain of that name is registered in this process or installed."""

    def __str__(self) -> str:  # the message as it is (a KeyError would show it quoted)
        return str(self.args[0]) if self.args else ""


def register_domain(name: str, factory: Callable[[], Domain]) -> None:
    _REGISTRY[name] = factory


def installed_domains() -> list[str]:
    """Every domain name this process can use: installed plug-ins and the ones registered in it."""
    return sorted({*_REGISTRY, *(point.name for point in _installed())})


def get_domain(name: str) -> Domain:
    if name not in _REGISTRY:
        _REGISTRY[name] = _installed_factory(name)
    return _REGISTRY[name]()


def settings_model(name: str) -> type[DomainSettings] | None:
    """The settings model the domain ``name`` declares (its factory's ``settings_model``); None when it declares
    none, or is not installed (using it fails where it is looked up, with the list of installed ones)."""
    if name not in _REGISTRY:
        try:
            _REGISTRY[name] = _installed_factory(name)
        except UnknownDomainError:
            return None
    return getattr(_REGISTRY[name], "settings_model", None)


def domain_for(config: RunConfig) -> Domain:
    """The run's domain, holding the run's ``domain_settings`` read by the model it declares, if it declares
    one (``DomainSettingsError`` for settings it does not accept)."""
    domain = get_domain(config.domain)
    if (settings := _read(config, getattr(domain, "settings_model", None))) is not None:
        domain.settings = settings  # type: ignore[attr-defined]
    return domain


def domain_settings(config: RunConfig) -> DomainSettings | None:
    """The run's ``domain_settings`` read by the model its domain declares (None: it declares none)."""
    return _read(config, settings_model(config.domain))


def _read(config: RunConfig, model: type[DomainSettings] | None) -> DomainSettings | None:
    try:
        return read_domain_settings(config.domain, config.domain_settings, model)
    except ValueError as exc:
        raise DomainSettingsError(str(exc)) from None


def _installed() -> list[EntryPoint]:
    return list(entry_points(group=ENTRY_POINT_GROUP))


def _installed_factory(name: str) -> Callable[[], Domain]:
    points = {point.value: point for point in _installed() if point.name == name}  # one package seen twice: once
    if not points:
        names = ", ".join(installed_domains()) or "none"
        raise UnknownDomainError(
            f"unknown domain {name!r}; installed domains: {names} (a domain package declares its factory in "
            f"the entry point group {ENTRY_POINT_GROUP!r})"
        )
    if len(points) > 1:
        raise UnknownDomainError(f"domain {name!r} is declared by more than one installed package: {', '.join(points)}")
    return next(iter(points.values())).load()


use_domain_registry(settings_model)  # fingerprints read a domain's settings with this registry's models
