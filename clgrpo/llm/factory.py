"""Which backend serves a model config: the one module that knows every backend.

The base module (``backends.py``) defines what a backend is and the OpenAI-compatible one; the local engines
import it. The factory sits above all of them, so no backend imports the module that chooses it.
"""

from __future__ import annotations

from clgrpo.llm.backends import Backend, OpenAIBackend
from clgrpo.llm.errors import PermanentLLMError
from schemas.config import ModelConfig


def make_backend(cfg: ModelConfig) -> Backend:
    if cfg.backend == "openai":
        return OpenAIBackend(cfg)
    if cfg.backend == "transformers":  # local engines: imported here so the core install needs no torch
        from clgrpo.llm.transformers_backend import TransformersBackend

        return TransformersBackend(cfg)
    if cfg.backend == "vllm":
        from clgrpo.llm.vllm_backend import VLLMBackend

        return VLLMBackend(cfg)
    raise PermanentLLMError(f"unknown backend {cfg.backend!r}")
