"""Calls to an inference worker, with every failure mapped to the error table.

A worker that cannot be reached (connection refused, or closed before answering) raises
`WorkerDown`: nothing was answered there, so the caller may retry on another worker. A
worker that took too long is `backend_timeout`; an error the worker answered (its own
OpenAI envelope, e.g. `context_length_exceeded`) is passed on as the same error.

Plain JSON calls go through `gateway.http1` (a small keep-alive HTTP/1.1 client); streams
through aiohttp (under load httpx's connection pool scanned every pooled connection on
every request, which cost the gateway most of its CPU: see docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

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


@contextlib.asynccontextmanager
async def mapped_errors(worker: Worker) -> AsyncIterator[None]:
    try:
        yield
    except (
        ConnectionLost,
        aiohttp.ClientConnectorError,
        aiohttp.ServerDisconnectedError,
        aiohttp.ConnectionTimeoutError,
    ) as exc:
        raise WorkerDown(worker, type(exc).__name__) from exc
    except TimeoutError as exc:
        raise BackendTimeout() from exc
    except aiohttp.ClientError as exc:
        raise BackendUnavailable(f"worker error: {type(exc).__name__}") from exc


def _raise_for(status: int, payload: bytes) -> None:
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError:
        body = None
    err = error_from_envelope(status, body)
    if type(err) is CtxError:  # not an envelope we know: a worker-side failure
        raise BackendUnavailable(f"worker answered {status}")
    raise err


def _content(body: dict[str, Any] | bytes) -> bytes:
    return body if isinstance(body, bytes) else orjson.dumps(body)


async def post_raw(worker: Worker, path: str, body: dict[str, Any] | bytes) -> tuple[int, bytes]:
    """Pass-through: the worker's status and body, as they are."""
    if worker.fast is not None:
        async with mapped_errors(worker):
            return await worker.fast.post(path, _content(body))
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
    """An open streaming response from a worker."""

    def __init__(self, worker: Worker, response: aiohttp.ClientResponse) -> None:
        self.worker = worker
        self.response = response

    async def events(self) -> AsyncIterator[bytes]:
        """Each `data:` payload, in order."""
        async with mapped_errors(self.worker):
            async for line in self.response.content:
                if line.startswith(b"data:"):
                    yield line[5:].strip()

    async def raw(self) -> AsyncIterator[bytes]:
        """The bytes as they come (pass-through)."""
        async with mapped_errors(self.worker):
            async for chunk in self.response.content.iter_any():
                yield chunk

    async def aclose(self) -> None:
        self.response.release()


async def open_stream(worker: Worker, path: str, body: dict[str, Any] | bytes) -> SSEStream:
    async with mapped_errors(worker):
        response = await worker.http.post(path, data=_content(body), headers=_JSON)
    if response.status >= 400:
        payload = await response.read()
        response.release()
        _raise_for(response.status, payload)
    return SSEStream(worker, response)
