"""A domain's own settings (``domain_settings`` in the run config): their base model, and how they are read.

A domain declares its settings model as the ``settings_model`` attribute of its factory (the class its
``clgrpo.domains`` entry point names). The run config keeps ``domain_settings`` as given: they are read, with one
error naming a wrong key or value, where the domain is resolved (``domains.registry.domain_for``) and where the
fingerprint needs them, by ``read_domain_settings``; so whether they are read never depends on what was imported
first. The schemas never look for a plug-in themselves: the domain registry hands its lookup here when it is
imported (``use_domain_registry``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError


class DomainSettings(BaseModel):
    """The base of a domain's own settings; the domain gets them through ``domains.registry.domain_for``."""

    model_config = ConfigDict(extra="forbid")

    def fingerprint_into(self, payload: dict[str, Any]) -> None:
        """Add what of these settings shapes results to the run config's fingerprint ``payload``: by default all
        of them, under ``domain_settings``, once any is changed from its default (runs that leave them alone keep
        the fingerprint they had before the domain had settings)."""
        if self != type(self)():
            payload["domain_settings"] = self.model_dump(mode="json")


SettingsModelLookup = Callable[[str], "type[DomainSettings] | None"]
_settings_model_of: SettingsModelLookup | None = None


def use_domain_registry(lookup: SettingsModelLookup) -> None:
    """Read ``domain_settings`` with the settings models that ``lookup`` finds (the domain registry's own: None
    for a domain that declares none or is not installed)."""
    global _settings_model_of
    _settings_model_of = lookup


def domain_settings_model(name: str) -> type[DomainSettings] | None:
    """The settings model the domain ``name`` declares, as the domain registry finds it; None when it declares
    none or is not installed (using an unknown domain fails where it is looked up, with the list of installed
    ones). Without a registry in this process (``domains`` not imported) a domain's settings cannot be read: a
    fingerprint, which needs them read, is refused."""
    if _settings_model_of is None:
        raise ValueError(
            f"domain_settings: no domain registry in this process to read the {name!r} domain's settings with "
            "(import domains)"
        )
    return _settings_model_of(name)


def read_domain_settings(
    domain: str, given: dict[str, Any], model: type[DomainSettings] | None
) -> DomainSettings | None:
    """``given`` read with the ``model`` the domain declares (None: it declares none, and none are given); a
    wrong key or value is one ``ValueError`` naming each, worded the same wherever they are read."""
    if model is None:
        if given:
            raise ValueError(
                f"domain_settings: the domain {domain!r} declares no settings of its own (or is not installed)"
            )
        return None
    try:
        return model.model_validate(given)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"domain_settings ({domain} domain): {problems}") from None
