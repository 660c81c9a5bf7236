"""ctxcache: a server-side context cache for multi-turn LLM serving.

This package holds what every service shares (the OpenAI schema base and error
envelope, settings and logging helpers, the bundled Redis launcher) and the
`ctxcache` command line. The services live in their own top-level packages:
`gateway`, `cache_manager`, `sidecar`, `worker`.
"""

__version__ = "0.1.0"
