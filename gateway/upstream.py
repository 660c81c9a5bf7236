"""Calls to an inference worker, with every failure mapped to the error table.

Every call goes through the worker's `WorkerClient` (gateway/worker_client.py). A worker
that cannot be reached (connection refused, or closed before answering) raises
`WorkerDown`: nothing was answered there, so the caller may retry on another worker. A
worker that took too long is `backend_timeout`; an answer that is not valid HTTP is a
worker failure (`backend_unavailable`); an error the worker answered (its own OpenAI
envelope, e.g. `context_length_exceeded`) is passed on as the same error. `failover` runs a
call on the next healthy worker when one is down.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import orjson

from ctxcache.errors import (
    BackendTimeout,
    BackendUnavailable,
    CtxError,
    InvalidRequest,
    error_from_envelope,
)
from gateway.pool import Worker, WorkerPool
from gateway.worker_client import Answer, ConnectionLost, Headers, Misframed

log = logging.getLogger(__name__)
T = TypeVar("T")


class WorkerDown(Exception):
    def __init__(self, worker: Worker, reason: str) -> None:
        super().__init__(reason)
        self.worker = worker


def mapped(worker: Worker, exc: Exception) -> Exception:
    """The error-table exception a failed call to `worker` stands for (`exc` itself if it
    is none of the transport's)."""
    if isinstance(exc, ConnectionLost):
        return WorkerDown(worker, str(exc))
    if isinstance(exc, TimeoutError):
        return BackendTimeout()
    if isinstance(exc, Misframed):
        return BackendUnavailable(f"worker {worker.id} sent a mis-framed answer")
    return exc


def reraise_mapped(worker: Worker, exc: Exception) -> NoReturn:
    error = mapped(worker, exc)
    if error is exc:
        raise exc
    raise error from exc


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
    if type(err) is not CtxError:
        return err
    if status in (400, 422) and isinstance(body, dict) and isinstance(body.get("error"), dict):
        # the engine refused what the client asked (a response_format it cannot compile,
        # say): the client's error, in the engine's words
        return InvalidRequest(err.message, param=err.param)
    return BackendUnavailable(f"worker answered {status}")


def _content(body: dict[str, Any] | bytes) -> bytes:
    return body if isinstance(body, bytes) else orjson.dumps(body)


async def post_raw(
    worker: Worker, path: str, body: dict[str, Any] | bytes, *, headers: Headers = ()
) -> tuple[int, bytes]:
    """Pass-through: the worker's status and body, as they are."""
    try:
        return await worker.client.post(path, _content(body), headers=headers)
    except Exception as exc:  # (no context manager: this runs on every request)
        reraise_mapped(worker, exc)


async def post_json(
    worker: Worker, path: str, body: dict[str, Any] | bytes, *, headers: Headers = ()
) -> dict[str, Any]:
    status, payload = await post_raw(worker, path, body, headers=headers)
    if status >= 400:
        raise worker_error(status, payload)
    return orjson.loads(payload)  # type: ignore[no-any-return]


class SSEStream:
    """An open streaming answer from a worker: its body as it arrives."""

    def __init__(self, worker: Worker, answer: Answer) -> None:
        self.worker = worker
        self.answer = answer

    async def raw(self) -> AsyncIterator[bytes]:
        """The bytes as they come (pass-through)."""
        async with mapped_errors(self.worker):
            async for chunk in self.answer.chunks():
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
        self.answer.close()


async def open_stream(
    worker: Worker, path: str, body: dict[str, Any] | bytes, *, headers: Headers = ()
) -> SSEStream:
    """Start a worker's stream: its answer's head is in, and it is not an error."""
    try:
        answer = await worker.client.request("POST", path, _content(body), headers=headers)
        if answer.status >= 400:
            raise worker_error(answer.status, await answer.read())
    except Exception as exc:  # (no context manager: this runs on every stream)
        reraise_mapped(worker, exc)
    return SSEStream(worker, answer)


async def failover(
    pool: WorkerPool,
    model: str,
    call: Callable[[Worker], Awaitable[T]],
    *,
    affinity: str | None = None,
    first: Worker | None = None,
) -> tuple[T, Worker]:
    """Run `call` on a worker; if that worker is down, on the next healthy one.

    Only a worker that could not be reached counts as down: nothing ran there, so
    running the call elsewhere is safe (the KV is recomputed there). When no healthy
    worker is left, `pick` raises `backend_unavailable`.
    """
    tried: list[str] = []
    worker = first or pool.pick(model, affinity=affinity)
    while True:
        try:
            async with pool.lease(worker):
                return await call(worker), worker
        except WorkerDown as exc:
            pool.mark_down(worker, str(exc))
            tried.append(worker.id)
            worker = pool.pick(model, exclude=tried)
            log.info("retrying on worker %s (KV is recomputed there)", worker.id)
