"""How a model call failed: worth retrying (transient) or not (permanent).

Every backend and the HTTP transport raise these; the client retries the transient ones. They live below the
backends so that the transport, the backends and the client share them without importing each other.
"""

from __future__ import annotations


class TransientLLMError(RuntimeError):
    """Worth retrying: rate limits, server errors, connection problems, timeouts."""

    def __init__(
        self, message: str, retry_after: float | None = None, rate_limited: bool = False, counted: bool = True
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.rate_limited = rate_limited
        self.counted = counted  # False: retry at once, not against max_retries (the request was adapted)


class SchemaRefused(TransientLLMError):
    """The endpoint refused the request's ``response_format`` (no structured output): asked again without it,
    and from then on the model's prompts are written for unconstrained replies (``schema_refused``)."""


class PermanentLLMError(RuntimeError):
    """Retrying will not help: bad request, authentication, unknown model."""


class ToolsRefused(PermanentLLMError):
    """The endpoint refused a request with ``tools``: it has no tool calling (use the text protocol)."""


class CountRefused(PermanentLLMError):
    """The endpoint refused ``n`` choices in one request (llama-server allows at most its slot count): the samples
    are asked for one per request instead, and from then on for this many or more."""
