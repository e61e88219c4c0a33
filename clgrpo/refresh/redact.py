"""Secrets out of production text: API keys, tokens, private keys and passwords in URLs become
``[REDACTED:<kind>]`` before a trace is stored or shown to a model.

A focused list, not a scanner: each pattern matches a shape that is a secret with near certainty (a vendor's
key prefix, a PEM block, a credential in a URL, a long token after ``key=`` / ``token=`` / ``secret=``), so
ordinary problem text (numbers, hashes in prose, math) stays as it is. E-mail addresses are kept unless asked.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

# (kind, pattern): group 1 is kept (a prefix such as "Bearer " or "key="), the rest of the match is replaced;
# applied in order, most specific first
PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("private_key", re.compile(r"()-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)")),
    ("api_key", re.compile(r"()\bsk-(?:proj-|ant-)?[A-Za-z0-9_-]{16,}")),  # OpenAI / Anthropic style
    ("aws_key", re.compile(r"()\b(?:AKIA|ASIA)[0-9A-Z]{16}\b")),
    ("github_token", re.compile(r"()\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{40,})")),
    ("slack_token", re.compile(r"()\bxox[abposr]-[A-Za-z0-9-]{10,}")),
    ("google_key", re.compile(r"()\bAIza[0-9A-Za-z_-]{35}")),
    ("jwt", re.compile(r"()\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}")),
    ("bearer_token", re.compile(r"(?i)(\bbearer\s+)[A-Za-z0-9._~+/=-]{16,}")),
    ("url_password", re.compile(r"(://[^\s:/@]+:)[^\s/@]+(?=@)")),  # scheme://user:password@host
    # key=..., access_token: ..., "secret": "..." followed by a long token with a digit in it
    (
        "credential",
        re.compile(
            r"(?i)((?:key|token|secret|password|passwd|pwd)[\"']?\s{0,3}[=:]\s{0,3}[\"']?)"
            r"(?=[A-Za-z0-9+/_=-]*\d)[A-Za-z0-9+/_=-]{16,}"
        ),
    ),
]
EMAIL = ("email", re.compile(r"()\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b"))


def _marked(kind: str) -> Callable[[re.Match[str]], str]:
    """The replacement of one kind's match: its kept prefix (group 1), then the marker."""
    return lambda match: f"{match.group(1)}[REDACTED:{kind}]"


@dataclass
class Redactor:
    """Replaces secrets in the texts it is given and counts them by kind (never keeping the secret)."""

    emails: bool = False
    counts: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __call__(self, text: str) -> str:
        for kind, pattern in PATTERNS + ([EMAIL] if self.emails else []):
            text, n = pattern.subn(_marked(kind), text)
            self.counts[kind] += n
        return text

    def summary(self) -> str:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(self.counts.items()) if n)
        return f"{self.total} secret(s) redacted ({kinds})" if self.total else "no secrets redacted"


def redact(text: str) -> str:
    """``text`` with its secrets replaced (no counting)."""
    return Redactor()(text)
