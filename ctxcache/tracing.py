"""OpenTelemetry tracing of every ctxcache service: off unless `OTEL_EXPORTER_OTLP_ENDPOINT`
is set (docs/operations.md).

Off, nothing of OpenTelemetry is imported, `span()` hands back one shared do-nothing context
manager (no span object is built), `outgoing_headers()` is empty and `server_middleware`
returns the app unchanged: the hot path pays one attribute read per call site.

On, each process exports its spans over OTLP/HTTP (protobuf) to `$OTEL_EXPORTER_OTLP_ENDPOINT`
`/v1/traces` in batches, as `ctxcache-<service>` (or `$OTEL_SERVICE_NAME`), and passes the
W3C `traceparent` on every call to the manager and the workers, so the manager's, the
built-in worker's and vLLM's own spans (`--otlp-traces-endpoint`, which `ctxcache vllm`
sets from the same variable) join the gateway's trace.

The tracer is process state, like OpenTelemetry's own global provider; this module keeps
its own provider (never the global one) so that tests can configure and shut it down.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (starlette only for types: the connector imports this without it)
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
SESSION_ATTR = "ctxcache.session_id"
_NOOP = contextlib.nullcontext()


class _State:
    tracer: Tracer | None = None
    provider: TracerProvider | None = None


_state = _State()


def traces_url(endpoint: str) -> str:
    """OTLP/HTTP's traces URL under a base endpoint (as the OpenTelemetry SDK builds it)."""
    return endpoint.rstrip("/") + "/v1/traces"


def configure(
    service: str, *, exporter: SpanExporter | None = None, endpoint: str | None = None
) -> bool:
    """Turn tracing on for this process if `endpoint` (default `$OTEL_EXPORTER_OTLP_ENDPOINT`)
    is set, or an `exporter` is given (tests: spans are exported one by one). Returns
    whether tracing is on."""
    endpoint = endpoint or os.environ.get(ENDPOINT_ENV, "").strip() or None
    if exporter is None and endpoint is None:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    shutdown()
    attributes = (
        {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": f"ctxcache-{service}"}
    )
    provider = TracerProvider(resource=Resource.create(attributes))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        assert endpoint is not None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(traces_url(endpoint))))
    _state.provider = provider
    _state.tracer = provider.get_tracer("ctxcache")
    return True


def shutdown() -> None:
    """Export what is pending and turn tracing off."""
    provider, _state.provider, _state.tracer = _state.provider, None, None
    if provider is not None:
        provider.shutdown()


def enabled() -> bool:
    return _state.tracer is not None


def span(
    name: str, attributes: dict[str, Any] | None = None, *, client: bool = False
) -> contextlib.AbstractContextManager[Any]:
    """A span around a block, current inside it (a child of the current one); off: a shared
    do-nothing context manager. `client`: the span is a call to another service, made only
    inside a traced request (a health check or a scrape's store call starts no trace)."""
    tracer = _state.tracer
    if tracer is None:
        return _NOOP
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind

    if client and not trace.get_current_span().get_span_context().is_valid:
        return _NOOP
    kind = SpanKind.CLIENT if client else SpanKind.INTERNAL
    return tracer.start_as_current_span(name, kind=kind, attributes=attributes)


def span_in(
    carrier: Mapping[str, str] | None,
    name: str,
    attributes: dict[str, Any] | None = None,
    *,
    server: bool = False,
) -> contextlib.AbstractContextManager[Any]:
    """A span, current inside the block, in the trace that `carrier` (W3C `traceparent`
    headers: vLLM's `trace_headers`, a request's `trace` field) names; off, or no valid
    trace in `carrier`: the shared do-nothing context manager. For work that runs outside
    the caller's context: the connector inside vLLM's engine, the sidecar's socket."""
    tracer = _state.tracer
    if tracer is None or not carrier or "traceparent" not in carrier:
        return _NOOP
    from opentelemetry import trace
    from opentelemetry.propagate import extract
    from opentelemetry.trace import SpanKind

    parent = extract(dict(carrier))
    if not trace.get_current_span(parent).get_span_context().is_valid:
        return _NOOP
    kind = SpanKind.SERVER if server else SpanKind.INTERNAL
    return tracer.start_as_current_span(name, context=parent, kind=kind, attributes=attributes)


def annotate(attributes: dict[str, Any]) -> None:
    """Set `attributes` on the current span (bytes moved, what was found...); off or
    outside a span: nothing."""
    if _state.tracer is None:
        return
    from opentelemetry import trace

    current = trace.get_current_span()
    if current.is_recording():
        current.set_attributes(attributes)


def carrier() -> dict[str, str] | None:
    """The current span as W3C headers, to hand to work done elsewhere (`span_in`); None
    when off or outside any span."""
    if _state.tracer is None:
        return None
    return inject({}) or None


def set_session(session_id: str) -> None:
    """Name the session on the current span (the request's, or a step of it)."""
    if _state.tracer is None:
        return
    from opentelemetry import trace

    current = trace.get_current_span()
    if current.is_recording():
        current.set_attribute(SESSION_ATTR, session_id)


def inject(headers: dict[str, str]) -> dict[str, str]:
    """`headers` plus the current span's `traceparent` (and `tracestate`); off or outside any
    span: `headers` as they are."""
    if _state.tracer is None:
        return headers
    from opentelemetry.propagate import inject as otel_inject

    out = dict(headers)
    otel_inject(out)
    return out


def outgoing_headers() -> list[tuple[bytes, bytes]]:
    """The trace headers of a call made now, as raw header pairs; empty when off."""
    if _state.tracer is None:
        return []
    return [(k.encode(), v.encode("latin-1")) for k, v in inject({}).items()]


_TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})  # W3C trace context, all we read
# probes and scrapes: every few seconds, from machines, never worth a trace
UNTRACED_PATHS = frozenset({"/health", "/ready", "/metrics"})
_ID_SEGMENT = re.compile(r"/(?=[^/]*\d)[^/]{16,}")


def route_name(path: str) -> str:
    """A low-cardinality span name for a raw path: id-like segments become `{id}`."""
    return _ID_SEGMENT.sub("/{id}", path)


def server_middleware(app: ASGIApp, service: str) -> ASGIApp:
    """`app` with a server span per HTTP request, continuing the caller's trace from its
    `traceparent`; off: `app` itself."""
    if _state.tracer is None:
        return app
    return TracingMiddleware(app, service)


class TracingMiddleware:
    """One SERVER span per HTTP request: named by route template (or the path with its ids
    masked), the caller's trace continued, the status recorded."""

    def __init__(self, app: ASGIApp, service: str) -> None:
        self.app = app
        self.service = service

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)  # (the wrapped app's `state`, ...)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracer = _state.tracer
        if scope["type"] != "http" or tracer is None or scope["path"] in UNTRACED_PATHS:
            await self.app(scope, receive, send)
            return
        from opentelemetry.propagate import extract
        from opentelemetry.trace import SpanKind, Status, StatusCode

        carrier = {
            k.decode(): v.decode("latin-1") for k, v in scope["headers"] if k in _TRACE_HEADERS
        }
        method = scope["method"]
        with tracer.start_as_current_span(
            f"{method} {route_name(scope['path'])}",
            context=extract(carrier),
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "ctxcache.service": self.service},
        ) as current:

            async def send_status(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status = message["status"]
                    current.set_attribute("http.response.status_code", status)
                    if status >= 500:
                        current.set_status(Status(StatusCode.ERROR))
                await send(message)

            try:
                await self.app(scope, receive, send_status)
            finally:
                if (route := getattr(scope.get("route"), "path", None)) is not None:
                    current.update_name(f"{method} {route}")
                    current.set_attribute("http.route", route)


def detached(
    name: str, attributes: dict[str, Any] | None = None
) -> contextlib.AbstractContextManager[Span | None]:
    """A span that is not made current (for a block that yields, such as a stream relayed
    to the client: a current span would leak into whatever runs between its steps); off:
    the shared do-nothing context manager."""
    tracer = _state.tracer
    if tracer is None:
        return _NOOP
    return _ended(tracer.start_span(name, attributes=attributes))


@contextlib.contextmanager
def _ended(current: Span) -> Iterator[Span]:
    try:
        yield current
    finally:
        current.end()
