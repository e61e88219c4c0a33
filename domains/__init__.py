"""Domains are plug-ins: dataset loading, verification, prompt templates and optional tools."""

from domains.base import (
    Domain,
    Tool,
    ToolContext,
    ToolFailure,
    ToolOutput,
    VerifyResult,
    get_domain,
    register_domain,
)

__all__ = [
    "Domain",
    "Tool",
    "ToolContext",
    "ToolFailure",
    "ToolOutput",
    "VerifyResult",
    "get_domain",
    "register_domain",
]
