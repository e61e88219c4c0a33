"""Models besides the chat client (local weights, embeddings, the LoRA step); remote calls' retries and API keys."""
