"""Calls to an inference worker, with every failure mapped to the error table.

A worker that cannot be reached (connection refused, or closed before answering) raises
`WorkerDown`: nothing was answered there, so the caller may retry on another worker. A
worker that took too long is `backend_timeout`; an error the worker answered (its own
OpenAI envelope, e.g. `context_length_exceeded`) is passed on as the same error.

Calls go through `gateway.http1` (a small keep-alive HTTP/1.1 client), streams included;
through aiohttp only to a worker behind https or a path prefix (under load httpx's
connection pool scanned every pooled connection on every request, which cost the gateway
most of its CPU, and aiohttp's per-request machinery was the next largest part: see
docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import aiohttp
import orjson

from ctxcache.errors import BackendTimeout, BackendUnavailable, CtxError, error_from_envelope
from gateway.http1 import ConnectionLost
from gateway.pool import Worker

_JSON = {"content-type": "application/json"}


class WorkerDown(Exception):
    def __init__(self, worker: Worker, reason: str) -> None:
        super().__init__(reason)
        self.worker = worker


def reraise_mapped(worker: Worker, exc: Exception) -> NoReturn:
    """Raise the error-table exception a failed call to `worker` stands for (`exc` itself
    if it is none of the transport's)."""
    error = _mapped(worker, exc)
    if error is exc:
        raise exc
    raise error from exc


def _mapped(worker: Worker, exc: Exception) -> Exception:
    if isinstance(
        exc,
        ConnectionLost
        | aiohttp.ClientConnectorError
        | aiohttp.ServerDisconnectedError
        | aiohttp.ConnectionTimeoutError,
    ):
        return WorkerDown(worker, type(exc).__name__)
    if isinstance(exc, TimeoutError):
        return BackendTimeout()
    if isinstance(exc, aiohttp.ClientError):
        return BackendUnavailable(f"worker error: {type(exc).__name__}")
    return exc


@contextlib.asynccontextmanager
async def mapped_errors(worker: Worker) -> AsyncIterator[None]:
    try:
        yield
    except Exception as exc:
        reraise_mapped(worker, exc)


def worker_error(status: int, payload: bytes) -> CtxError:
    """The error a worker's error answer stands for: its own envelope's, if it is one we
    know; otherwise a worker-side failure."""
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError:
        body = None
    err = error_from_envelope(status, body)
    if type(err) is CtxError:
        return BackendUnavailable(f"worker answered {status}")
    return err


def _raise_for(status: int, payload: bytes) -> NoReturn:
    raise worker_error(status, payload)


def _content(body: dict[str, Any] | bytes) -> bytes:
    return body if isinstance(body, bytes) else orjson.dumps(body)


async def post_raw(worker: Worker, path: str, body: dict[str, Any] | bytes) -> tuple[int, bytes]:
    """Pass-through: the worker's status and body, as they are."""
    if worker.fast is not None:  # (the hot path: no context manager to enter and leave)
        try:
            return await worker.fast.post(path, _content(body))
        except Exception as exc:
            reraise_mapped(worker, exc)
    async with (
        mapped_errors(worker),
        worker.http.post(path, data=_content(body), headers=_JSON) as r,
    ):
        return r.status, await r.read()


async def post_json(worker: Worker, path: str, body: dict[str, Any] | bytes) -> dict[str, Any]:
    status, payload = await post_raw(worker, path, body)
    if status >= 400:
        _raise_for(status, payload)
    return orjson.loads(payload)  # type: ignore[no-any-return]


class SSEStream:
    """An open streaming response from a worker: its body as it arrives."""

    def __init__(
        self,
        worker: Worker,
        chunks: AsyncIterator[bytes],
        close: Callable[[], object],
        framed: Callable[[], AsyncIterator[bytes]] | None = None,
    ) -> None:
        self.worker = worker
        self._chunks = chunks
        self._close = close
        self.framed = framed  # a chunked body with its framing kept (`Response.framed`)

    async def raw(self) -> AsyncIterator[bytes]:
        """The bytes as they come (pass-through)."""
        async with mapped_errors(self.worker):
            async for chunk in self._chunks:
                yield chunk

    async def events(self) -> AsyncIterator[bytes]:
        """Each `data:` payload, in order."""
        rest = b""
        async for chunk in self.raw():
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            for line in lines:
                if line.startswith(b"data:"):
                    yield line[5:].strip()
        if rest.startswith(b"data:"):  # a last event without its newline
            yield rest[5:].strip()

    async def aclose(self) -> None:
        self._close()


async def open_stream(worker: Worker, path: str, body: dict[str, Any] | bytes) -> SSEStream:
    """Start a worker's stream: its answer's head is in, and it is not an error."""
    async with mapped_errors(worker):
        if worker.fast is not None:
            answer = await worker.fast.stream(path, _content(body))
            if answer.status >= 400:
                _raise_for(answer.status, await answer.read())
            framed = answer.framed if answer.chunked else None
            return SSEStream(worker, answer.chunks(), answer.close, framed)
        response = await worker.http.post(path, data=_content(body), headers=_JSON)
        if response.status >= 400:
            payload = await response.read()
            response.release()
            _raise_for(response.status, payload)
        return SSEStream(worker, response.content.iter_any(), response.release)
