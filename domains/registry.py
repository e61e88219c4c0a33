"""Finding a domain plug-in by name: an open registry.

A domain is installed, not listed here: a package declares its factory (a callable that takes no argument and
returns a ``Domain``) in the entry point group ``clgrpo.domains``, as this project does for its own two::

    [project.entry-points."clgrpo.domains"]
    math = "domains.math:MathDomain"

``get_domain(name)`` imports only the plug-in it is asked for, on first use. ``register_domain`` adds a factory
in this process only (a test's stand-in, a notebook), and wins over an installed plug-in of the same name.

A domain with settings of its own declares their model (a ``schemas.config.DomainSettings``) as its factory's
``settings_model``: this registry is the one that finds it (the run config validates ``domain_settings`` with
the lookup it hands to ``schemas.config`` on import; the schemas load no plug-in), and ``domain_for(config)``
gives the domain its settings (its ``settings`` attribute). ``domains/web`` is the worked example.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

from domains.base import Domain
from schemas.config import DomainSettings, RunConfig, use_domain_registry

ENTRY_POINT_GROUP = "clgrpo.domains"

_REGISTRY: dict[str, Callable[[], Domain]] = {}


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
    """The run's domain, holding the run's ``domain_settings`` (validated by the run config) when it has a model
    for them."""
    domain = get_domain(config.domain)
    if (model := getattr(domain, "settings_model", None)) is not None:
        domain.settings = model.model_validate(config.domain_settings)  # type: ignore[attr-defined]
    return domain


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


use_domain_registry(settings_model)  # the run config reads a domain's settings with this registry's models
