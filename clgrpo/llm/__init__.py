"""The one LLM client and its backends."""

from clgrpo.llm.client import Completed, Completion, LLMCallError, LLMClient, OperationsReply, Sampled, shared_client

__all__ = ["Completed", "Completion", "LLMCallError", "LLMClient", "OperationsReply", "Sampled", "shared_client"]
