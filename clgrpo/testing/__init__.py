"""Test and benchmark helpers (a fake OpenAI-compatible server)."""
