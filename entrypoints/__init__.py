"""Entrypoints: LLM API, CLI, servers."""
