"""Calls to an inference worker, with every failure mapped to the error table.

Every call goes through the worker's `WorkerClient` (gateway/worker_client.py). A worker
that cannot be reached (connection refused, or closed before answering) raises
`WorkerDown`: nothing was answered there, so the caller may retry on another worker. A
worker that took too long is `backend_timeout`; an answer that is not valid HTTP is a
worker failure (`backend_unavailable`); an error the worker answered (its own OpenAI
envelope, e.g. `context_length_exceeded`) is passed on as the same error, and an engine's
refusal in another envelope (vLLM's `"type": "BadRequestError", "code": 400`) in ours
(`refusal`, `refused_payload`). `failover` runs a call on the next healthy worker when one
is down.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import orjson

from ctxcache.errors import (
    BackendTimeout,
    BackendUnavailable,
    ContextLengthExceeded,
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


class EngineRefusal(InvalidRequest):
    """A 4xx the engine answered in an envelope not ours (vLLM's `ErrorResponse`: `type`
    the HTTP phrase, `code` the status as a number): the client's error in the engine's
    words (its message and `param`) and with its status, in our envelope
    (`invalid_request_error`, a string `code`: the engine's own if it is a string, else the
    status's, `STATUS_CODES`)."""

    def __init__(self, message: str, *, param: str | None, status: int, code: str) -> None:
        super().__init__(message, param=param)
        self.status = status  # (per refusal: the engine's)
        self.code = code


STATUS_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
_TOO_LONG = re.compile(r"maximum context length", re.IGNORECASE)  # vLLM's words for it


def _decoded(payload: bytes) -> Any:
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None


def refusal(status: int, body: Any) -> CtxError | None:
    """The error an engine's 4xx answer (`body`, decoded) stands for, if it carries an
    error envelope: its own error if the envelope is ours (the built-in worker's), else an
    `EngineRefusal` (a prompt over the window: `context_length_exceeded`, as OpenAI and the
    built-in worker name it). None: not a 4xx with an envelope."""
    info = body.get("error") if isinstance(body, dict) else None
    if not 400 <= status < 500 or not isinstance(info, dict):
        return None
    err = error_from_envelope(status, body)
    if type(err) is not CtxError:
        return err  # a code of ours
    param = info.get("param") if isinstance(info.get("param"), str) else None
    if status == 400 and _TOO_LONG.search(err.message):
        return ContextLengthExceeded(err.message, param=param)
    code = info.get("code")
    if not isinstance(code, str) or not code:
        code = STATUS_CODES.get(status, "invalid_request")
    return EngineRefusal(err.message, param=param, status=status, code=code)


def refused_payload(status: int, payload: bytes) -> bytes:
    """A pass-through's error answer: an engine's 4xx refusal in our envelope (`refusal`);
    anything else (ours already, a 5xx, a body with no envelope) as it is."""
    body = _decoded(payload)
    err = refusal(status, body)
    if err is None or (isinstance(body, dict) and body.get("error") == err.envelope()["error"]):
        return payload
    return orjson.dumps(err.envelope())


def worker_error(status: int, payload: bytes) -> CtxError:
    """The error a worker's error answer stands for: its own envelope's, if it is one we
    know; an engine's 4xx refusal (`refusal`: the client's error, in the engine's words and
    with its status); otherwise a worker-side failure."""
    body = _decoded(payload)
    refused = refusal(status, body)
    if refused is not None:
        return refused
    err = error_from_envelope(status, body)
    if type(err) is not CtxError:
        return err
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
