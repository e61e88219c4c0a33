"""Domains are plug-ins: dataset loading, verification, prompt templates and optional tools.

The protocol they implement is in ``domains/base.py``; ``get_domain`` finds one by name among the installed
plug-ins (entry point group ``clgrpo.domains``, ``domains/registry.py``).
"""

from domains.base import (
    Domain,
    Tool,
    ToolContext,
    ToolFailure,
    ToolOutput,
    VerifyResult,
)
from domains.registry import (
    DomainSettingsError,
    UnknownDomainError,
    domain_for,
    domain_settings,
    get_domain,
    installed_domains,
    register_domain,
)

__all__ = [
    "Domain",
    "DomainSettingsError",
    "Tool",
    "ToolContext",
    "ToolFailure",
    "ToolOutput",
    "UnknownDomainError",
    "VerifyResult",
    "domain_for",
    "domain_settings",
    "get_domain",
    "installed_domains",
    "register_domain",
]
