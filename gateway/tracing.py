"""What the gateway's calls to a worker carry for tracing (`ctxcache.tracing`).

The worker client calls `outgoing_headers()` for every request it writes: the W3C
`traceparent` (and `tracestate`) of the span current at the call, so the worker's own spans
(the built-in worker's, or vLLM's with `--otlp-traces-endpoint`) join the gateway's trace.
Empty when tracing is off, so a request is written as it always was.
"""

from __future__ import annotations

from ctxcache.tracing import outgoing_headers

__all__ = ["outgoing_headers"]
