"""Domain exceptions and the single function that maps them to HTTP + the OpenAI envelope.

Services raise these; routers never build error JSON by hand. Clients of our own
services (manager client, worker client) turn an envelope back into the same exception
with `error_from_envelope`, so a `SessionNotFound` raised in the manager surfaces as a
`SessionNotFound` in the gateway.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ctxcache.responses import JSONResponse
from ctxcache.schema import ErrorInfo, ErrorResponse

log = logging.getLogger(__name__)


class CtxError(Exception):
    """Base of every error a client may see. Subclasses set status, code and type."""

    status: ClassVar[int] = 500
    code: ClassVar[str | None] = "internal_error"
    type: ClassVar[str] = "server_error"
    default_message: ClassVar[str] = "internal error"

    def __init__(
        self,
        message: str | None = None,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.message = message or self.default_message
        self.param = param
        self.headers = headers or {}
        super().__init__(self.message)

    def envelope(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


class InvalidRequest(CtxError):
    status, code, type = 400, "invalid_request", "invalid_request_error"
    default_message = "invalid request"


class InvalidTTL(CtxError):
    status, code, type = 400, "invalid_ttl", "invalid_request_error"
    default_message = "invalid ttl"


class SessionModelMismatch(CtxError):
    status, code, type = 400, "session_model_mismatch", "invalid_request_error"
    default_message = "the model differs from the session's model"


class ContextLengthExceeded(CtxError):
    status, code, type = 400, "context_length_exceeded", "invalid_request_error"
    default_message = "the session context plus the new input exceed the model's window"


class InvalidAPIKey(CtxError):
    status, code, type = 401, "invalid_api_key", "authentication_error"
    default_message = "missing or invalid API key"


class SessionNotFound(CtxError):
    status, code, type = 404, "session_not_found", "invalid_request_error"
    default_message = "session not found"


class NotFound(CtxError):
    status, code, type = 404, "not_found", "invalid_request_error"
    default_message = "not found"


class PreviousResponseNotFound(CtxError):
    """An unknown, deleted, expired, unstored or another tenant's `previous_response_id`:
    OpenAI's answer, word for word (a 400, not a 404)."""

    status, code, type = 400, "previous_response_not_found", "invalid_request_error"

    @classmethod
    def of(cls, response_id: str) -> PreviousResponseNotFound:
        return cls(
            f"Previous response with id '{response_id}' not found.", param="previous_response_id"
        )


class ResponseNotFound(CtxError):
    """`GET/DELETE /v1/responses/{id}` of an id this tenant has no stored response for."""

    status, code, type = 404, None, "invalid_request_error"

    @classmethod
    def of(cls, response_id: str) -> ResponseNotFound:
        return cls(f"Response with id '{response_id}' not found.")


class ConversationNotFound(CtxError):
    status, code, type = 404, None, "invalid_request_error"

    @classmethod
    def of(cls, conversation_id: str, *, param: str | None = None) -> ConversationNotFound:
        return cls(f"Conversation with id '{conversation_id}' not found.", param=param)


class MethodNotAllowed(CtxError):
    status, code, type = 405, "method_not_allowed", "invalid_request_error"
    default_message = "method not allowed"


class SessionBusy(CtxError):
    status, code, type = 409, "session_busy", "conflict_error"
    default_message = "a turn is already in flight on this session"

    def __init__(self, message: str | None = None, *, retry_after_ms: int = 250) -> None:
        super().__init__(message, headers={"retry-after-ms": str(retry_after_ms)})
        self.retry_after_ms = retry_after_ms


class VersionConflict(CtxError):
    """Compare-and-set lost: the session changed since the writer read it (internal)."""

    status, code, type = 409, "version_conflict", "conflict_error"
    default_message = "the session was modified concurrently"


class IdempotencyKeyReused(CtxError):
    """An `Idempotency-Key` already used for a request with another body (or route)."""

    status, code, type = 409, "idempotency_key_reused", "invalid_request_error"
    default_message = (
        "this Idempotency-Key was already used with a different request: use a new key"
    )


class RequestInProgress(CtxError):
    """The first attempt with this `Idempotency-Key` is still running."""

    status, code, type = 409, "request_in_progress", "conflict_error"
    default_message = (
        "a request with this Idempotency-Key is still in progress: retry after it finishes"
    )

    def __init__(self, message: str | None = None, *, retry_after_ms: int = 1000) -> None:
        super().__init__(message, headers={"retry-after-ms": str(retry_after_ms)})
        self.retry_after_ms = retry_after_ms


class PayloadTooLarge(CtxError):
    status, code, type = 413, "request_too_large", "invalid_request_error"
    default_message = "request body too large"


class QuotaExceeded(CtxError):
    status, code, type = 429, "quota_exceeded", "rate_limit_error"
    default_message = "tenant quota exceeded"

    @classmethod
    def sessions(cls, live: int) -> QuotaExceeded:
        """The tenant has its maximum of live sessions."""
        return cls(f"tenant has {live} live sessions, the maximum")

    @classmethod
    def tokens(cls) -> QuotaExceeded:
        """The tenant's context tokens would pass its quota."""
        return cls("tenant context-token quota exhausted")


class RateLimited(CtxError):
    """A key's requests or tokens per minute are used up (gateway/limits.py). The answer
    carries `retry-after`, `retry-after-ms` and the `x-ratelimit-*` headers."""

    status, code, type = 429, "rate_limit_exceeded", "rate_limit_exceeded"
    default_message = "rate limit reached"


def retry_headers(seconds: float) -> dict[str, str]:
    """`retry-after` (whole seconds, as HTTP has it) and `retry-after-ms` (which the openai
    SDKs read first) for a 503 worth retrying in `seconds`."""
    return {
        "retry-after": str(max(1, math.ceil(seconds))),
        "retry-after-ms": str(int(seconds * 1000)),
    }


class BackendUnavailable(CtxError):
    """No worker can take the request now: down, or (re)starting. `retry_after_s` is how
    long until one is expected (`gateway/components.py` knows an engine's start time)."""

    status, code, type = 503, "backend_unavailable", "server_error"
    default_message = "no healthy inference worker"

    def __init__(
        self, message: str | None = None, *, param: str | None = None, retry_after_s: float = 1.0
    ) -> None:
        super().__init__(message, param=param, headers=retry_headers(retry_after_s))


class StoreUnavailable(CtxError):
    """Redis unreachable, or its master failing over: nothing was written by the call that
    failed, except a write whose reply was lost (documented in docs/deploy.md)."""

    status, code, type = 503, "store_unavailable", "server_error"
    default_message = "the session store is unavailable"

    def __init__(self, message: str | None = None, *, retry_after_ms: int = 1000) -> None:
        # about how long a Redis restart or a Sentinel / Cluster failover takes to be over
        super().__init__(message, headers=retry_headers(retry_after_ms / 1000))


class ManagerRefused(StoreUnavailable):
    """The manager service answered 401 to this gateway: its manager token is not the
    manager's. A deployment error, so a 503 and not the client's `401 invalid_api_key`
    (which would blame the client's own key). `answered`: the manager's status."""

    default_message = "the context manager refused this gateway (misconfigured)"

    def __init__(self, message: str | None = None, *, answered: int = 401) -> None:
        super().__init__(message)
        self.answered = answered


class BackendTimeout(CtxError):
    status, code, type = 504, "backend_timeout", "server_error"
    default_message = "the inference worker timed out"


def _registry() -> dict[str, type[CtxError]]:
    found: dict[str, type[CtxError]] = {}
    stack: list[type[CtxError]] = [CtxError]
    while stack:
        cls = stack.pop()
        if cls.code is not None:
            found.setdefault(cls.code, cls)
        stack.extend(cls.__subclasses__())
    return found


def error_from_envelope(status: int, body: Any) -> CtxError:
    """Rebuild the domain exception from an error envelope another service returned."""
    info = body.get("error") if isinstance(body, dict) else None
    if not isinstance(info, dict):
        err = CtxError(f"upstream answered {status} without an error envelope")
        return err
    cls = _registry().get(str(info.get("code")), CtxError)
    message = str(info.get("message") or cls.default_message)
    if cls in (SessionBusy, StoreUnavailable, RequestInProgress):
        return cls(message)
    return cls(message, param=info.get("param"))


def error_response(exc: CtxError) -> JSONResponse:
    return JSONResponse(exc.envelope(), status_code=exc.status, headers=exc.headers or None)


def _from_http_exception(exc: StarletteHTTPException) -> CtxError:
    if isinstance(exc.__cause__, CtxError):  # e.g. FastAPI's "error parsing the body" over
        return exc.__cause__  # our body limit's 413
    if exc.status_code == 404:
        return NotFound(str(exc.detail) if exc.detail != "Not Found" else None)
    if exc.status_code == 405:
        return MethodNotAllowed(headers=dict(exc.headers or {}))  # Allow: the methods
    if exc.status_code == 413:
        return PayloadTooLarge()
    if 400 <= exc.status_code < 500:
        return InvalidRequest(str(exc.detail))
    return CtxError(str(exc.detail))


def validation_detail(errors: Sequence[Mapping[str, Any]]) -> tuple[str, str | None]:
    """The first pydantic error as `(message, param)`, param dotted without the location."""
    if not errors:
        return "malformed request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    param = ".".join(loc) or None
    where = f" ({param})" if param else ""
    return f"{first.get('msg', 'invalid value')}{where}", param


def validation_error(errors: Sequence[Mapping[str, Any]]) -> CtxError:
    """The one mapping of a body that fails validation: a bad `ttl` is `invalid_ttl`."""
    message, param = validation_detail(errors)
    cls: type[CtxError] = InvalidTTL if param == "ttl" else InvalidRequest
    return cls(message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the app in the OpenAI envelope: ours, HTTP, validation, crashes."""

    async def on_ctx_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, CtxError)
        return error_response(exc)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(_from_http_exception(exc))

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc.errors()))

    async def on_crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(CtxError())

    app.add_exception_handler(CtxError, on_ctx_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(Exception, on_crash)
