"""Domains are plug-ins: dataset loading, verification, prompt templates and optional tools."""

from domains.base import Domain, VerifyResult, get_domain, register_domain

__all__ = ["Domain", "VerifyResult", "get_domain", "register_domain"]
