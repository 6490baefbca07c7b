"""Batch-tier execution tests run on the session's real vLLM CPU replicas (``vllm_urls`` in
tests/conftest.py), which they share and never kill or pause."""
