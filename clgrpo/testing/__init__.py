"""Test and benchmark helpers: loopback fakes of remote models (OpenAI-compatible chat, /v1/embeddings) and of
the web on one server base (loopback.py) with one fault model (faults.py), and the scripted world their replies
come from (scripted_llm.py)."""
