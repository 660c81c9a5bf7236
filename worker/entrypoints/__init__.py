"""The HTTP API, one package per endpoint (after vLLM's entrypoints/openai layout)."""
