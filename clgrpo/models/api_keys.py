"""API keys of remote model endpoints: from the configured environment variable, else a Prefect Secret block.

Both clients of remote models read their key here: the LLM client's OpenAI-compatible backend
(``clgrpo.llm.backends``) and the ``/v1/embeddings`` client (``clgrpo.models.embeddings``); so does preflight. A key is
read when a client is made and never stored anywhere.
"""

from __future__ import annotations

import os
from typing import Protocol


class KeySource(Protocol):
    """Where a config says its API key is (a model's or an embedding endpoint's config)."""

    @property
    def api_key_env(self) -> str | None: ...

    @property
    def api_key_secret_block(self) -> str | None: ...


def resolve_api_key(cfg: KeySource) -> str | None:
    """From the configured environment variable, else a Prefect Secret block; never stored anywhere."""
    if cfg.api_key_env and os.environ.get(cfg.api_key_env):
        return os.environ[cfg.api_key_env]
    if cfg.api_key_secret_block:
        from prefect.blocks.system import Secret

        # inside an event loop (where backends are made) a plain load() returns a coroutine: _sync loads now
        secret = Secret.load(cfg.api_key_secret_block, _sync=True)  # type: ignore[call-arg]  # prefect's own flag
        assert isinstance(secret, Secret)
        return secret.get()
    return None
