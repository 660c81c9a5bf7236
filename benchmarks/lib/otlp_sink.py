"""A local OTLP/HTTP trace receiver: what a collector would get, kept in memory.

`ctxcache bench gateway --tracing` points traced services at one (the export costs what
it costs against a real collector on the same machine, without a collector to install);
the tracing tests read the spans it received from other processes.
"""

from __future__ import annotations

import argparse
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any] = field(default_factory=dict)


class OtlpSink:
    """`POST /v1/traces` (protobuf `ExportTraceServiceRequest`) on 127.0.0.1; `decode`:
    keep the spans (`spans()`), else only count the requests and bytes."""

    def __init__(self, *, decode: bool = True, port: int = 0) -> None:
        self.decode = decode
        self.requests = 0
        self.bytes = 0
        self._bodies: list[bytes] = []
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a collector answers

            def do_GET(self) -> None:  # /health, for whoever started it
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                sink._received(self.path, body)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        """The base URL to give as `OTEL_EXPORTER_OTLP_ENDPOINT`."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> OtlpSink:
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Answer in this thread until the process ends (`python -m`: the sink alone)."""
        self._server.serve_forever()

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _received(self, path: str, body: bytes) -> None:
        with self._lock:
            self.requests += 1
            self.bytes += len(body)
            if self.decode and path == "/v1/traces":
                self._bodies.append(body)

    def spans(self) -> list[ReceivedSpan]:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        with self._lock:
            bodies = list(self._bodies)
        out: list[ReceivedSpan] = []
        for body in bodies:
            request = ExportTraceServiceRequest.FromString(body)
            for resource in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource.resource.attributes}
                service = attrs.get("service.name", "")
                for scope in resource.scope_spans:
                    for s in scope.spans:
                        out.append(
                            ReceivedSpan(
                                service=service,
                                name=s.name,
                                trace_id=s.trace_id.hex(),
                                span_id=s.span_id.hex(),
                                parent_id=s.parent_span_id.hex(),
                                kind=s.kind,
                                attributes={a.key: _value(a.value) for a in s.attributes},
                            )
                        )
        return out


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def main() -> None:
    """`python -m benchmarks.lib.otlp_sink --port N`: a receiver that only counts (bench)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    sink = OtlpSink(decode=False, port=args.port)
    sink.serve_forever()


if __name__ == "__main__":
    main()
