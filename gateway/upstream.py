"""Calls to an inference worker, with every failure mapped to the error table.

A worker that cannot be reached (connection refused or reset before a byte came back)
raises `WorkerDown`: nothing happened there, so the caller may retry on another worker.
A worker that took too long is `backend_timeout`; an error the worker answered (its own
OpenAI envelope, e.g. `context_length_exceeded`) is passed on as the same error.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from ctxcache.errors import BackendTimeout, BackendUnavailable, CtxError, error_from_envelope
from gateway.pool import Worker


class WorkerDown(Exception):
    def __init__(self, worker: Worker, reason: str) -> None:
        super().__init__(reason)
        self.worker = worker


_JSON = {"content-type": "application/json"}


@contextlib.asynccontextmanager
async def mapped_errors(worker: Worker) -> AsyncIterator[None]:
    try:
        yield
    except (httpx.ConnectError, httpx.RemoteProtocolError) as exc:
        raise WorkerDown(worker, type(exc).__name__) from exc
    except httpx.TimeoutException as exc:
        if isinstance(exc, httpx.ConnectTimeout):
            raise WorkerDown(worker, "connect timeout") from exc
        raise BackendTimeout() from exc
    except httpx.HTTPError as exc:
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


async def post_json(worker: Worker, path: str, body: dict[str, Any] | bytes) -> dict[str, Any]:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    async with mapped_errors(worker):
        r = await worker.http.post(path, content=content, headers=_JSON)
    if r.status_code >= 400:
        _raise_for(r.status_code, r.content)
    return orjson.loads(r.content)  # type: ignore[no-any-return]


async def post_raw(worker: Worker, path: str, content: bytes) -> tuple[int, bytes]:
    """Pass-through: the worker's status and body, as they are."""
    async with mapped_errors(worker):
        r = await worker.http.post(path, content=content, headers=_JSON)
    return r.status_code, r.content


class SSEStream:
    """An open streaming response from a worker: `events()` yields each `data:` payload."""

    def __init__(self, response: httpx.Response, ctx: Any) -> None:
        self.response = response
        self._ctx = ctx

    async def events(self) -> AsyncIterator[bytes]:
        buf = b""
        try:
            async for chunk in self.response.aiter_raw():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if line.startswith(b"data:"):
                            yield line[5:].strip()
        except httpx.TimeoutException as exc:
            raise BackendTimeout() from exc
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"worker stream broke: {type(exc).__name__}") from exc

    async def aclose(self) -> None:
        await self._ctx.__aexit__(None, None, None)


async def open_stream(worker: Worker, path: str, body: dict[str, Any] | bytes) -> SSEStream:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    ctx = worker.http.stream("POST", path, content=content, headers=_JSON)
    async with mapped_errors(worker):
        response = await ctx.__aenter__()
    if response.status_code >= 400:
        payload = await response.aread()
        await ctx.__aexit__(None, None, None)
        _raise_for(response.status_code, payload)
    return SSEStream(response, ctx)
