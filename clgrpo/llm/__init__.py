"""The one LLM client, its backends and in-process engines, and the policy's LoRA adapters they load."""

from clgrpo.llm.client import Completed, Completion, LLMCallError, LLMClient, OperationsReply, Sampled, shared_client

__all__ = ["Completed", "Completion", "LLMCallError", "LLMClient", "OperationsReply", "Sampled", "shared_client"]
