"""The one LLM client and its backends."""

from clgrpo.llm.client import Completed, LLMCallError, LLMClient, OperationsReply, Sample, Sampled, shared_client

__all__ = ["Completed", "LLMCallError", "LLMClient", "OperationsReply", "Sample", "Sampled", "shared_client"]
