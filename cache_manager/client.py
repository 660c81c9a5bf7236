"""Async client of the manager: over HTTP, or the same service called in-process.

The gateway uses one interface whether the manager is a separate service
(`ManagerClient.over_http`) or runs inside the gateway process
(`ManagerClient.in_process(app)`, as `ctxcache serve` does). In-process, the calls go
straight to the app's `SessionService` — the object every HTTP route calls — with the same
request models and the same errors: no JSON, no ASGI hop, no token (there is no network
boundary to guard). That hop was a third of a session turn's manager cost (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

import httpx
import orjson
from fastapi import FastAPI
from pydantic import BaseModel

from cache_manager.keys import valid_session_id
from cache_manager.protocol import (
    AppendTurn,
    BeginTurn,
    Claim,
    ClaimKey,
    CreateSession,
    EditItems,
    FindImplicit,
    ImplicitFound,
    ItemsEdited,
    LockRenewed,
    ManagerStats,
    MarkPrefixes,
    RateSettle,
    RateTake,
    RateWindow,
    ReleaseLock,
    RenewLock,
    ResponseDeleted,
    ResponseRecord,
    SessionInfo,
    SessionList,
    SessionState,
    TenantUsage,
    UpdateSession,
)
from cache_manager.ratelimits import RateLimitStore
from cache_manager.service import SessionService
from ctxcache import tracing
from ctxcache.errors import (
    ManagerRefused,
    SessionNotFound,
    StoreUnavailable,
    error_from_envelope,
)

M = TypeVar("M", bound=BaseModel)


class Transport(Protocol):
    """How the client reaches the manager: `(status, body)` for one JSON request."""

    async def __call__(
        self, method: str, path: str, query: dict[str, Any] | None, body: bytes | None
    ) -> tuple[int, bytes]: ...

    async def aclose(self) -> None: ...


class HttpTransport:
    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    async def __call__(
        self, method: str, path: str, query: dict[str, Any] | None, body: bytes | None
    ) -> tuple[int, bytes]:
        headers = _JSON if body is not None else None
        if tracing.enabled():  # the manager's spans join this trace
            headers = tracing.inject(headers or {})
        r = await self.http.request(method, path, content=body, params=query, headers=headers)
        return r.status_code, r.content

    async def aclose(self) -> None:
        await self.http.aclose()


_JSON = {"content-type": "application/json"}
log = logging.getLogger(__name__)
_SAY_EVERY_S = 10.0  # a manager that refuses this gateway is logged at most this often


class ManagerClient:
    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._said_at = -_SAY_EVERY_S

    @classmethod
    def over_http(
        cls, base_url: str, *, token: str | None = None, timeout_s: float = 5.0
    ) -> ManagerClient:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=128)
        http = httpx.AsyncClient(
            base_url=base_url, headers=headers, timeout=timeout_s, limits=limits
        )
        return cls(HttpTransport(http))

    @staticmethod
    @asynccontextmanager
    async def in_process(app: FastAPI) -> AsyncIterator[ManagerClient]:
        """Run the manager app's lifespan here and call its service directly."""
        async with app.router.lifespan_context(app):
            yield LocalManager(app.state.service, app.state.rate_limits)

    async def aclose(self) -> None:
        await self.transport.aclose()

    @staticmethod
    def _path(session_id: str, suffix: str = "") -> str:
        # An id not shaped like ours cannot exist (and may not be a safe path segment).
        if not valid_session_id(session_id):
            raise SessionNotFound()
        return f"/sessions/{session_id}{suffix}"

    async def _call(
        self,
        method: str,
        path: str,
        model: type[M] | None,
        *,
        body: BaseModel | None = None,
        params: dict[str, Any] | None = None,
    ) -> M | None:
        content = body.model_dump_json(exclude_none=True).encode() if body is not None else None
        try:
            if tracing.enabled():
                with tracing.span(*_span_of(method, path), client=True):
                    status, payload = await self.transport(method, path, params, content)
            else:
                status, payload = await self.transport(method, path, params, content)
        except httpx.HTTPError as exc:
            raise StoreUnavailable(f"manager unreachable: {type(exc).__name__}") from exc
        if status == 401:  # the manager refuses this gateway, not the client's key
            raise self._refused()
        if status >= 400:
            try:
                envelope = orjson.loads(payload)
            except orjson.JSONDecodeError:
                envelope = None
            raise error_from_envelope(status, envelope)
        return model.model_validate_json(payload) if model is not None else None

    def _refused(self) -> ManagerRefused:
        """The manager service answered 401: this gateway's manager token is not the
        manager's. A deployment error, not the client's: `503 store_unavailable`, and an
        error in the log."""
        if time.monotonic() - self._said_at > _SAY_EVERY_S:
            self._said_at = time.monotonic()
            log.error(
                "the context manager refuses this gateway (401): CTX_GATEWAY_MANAGER_TOKEN "
                "is not the manager's CTX_MANAGER_TOKEN; session requests answer 503"
            )
        return ManagerRefused()

    async def create(self, req: CreateSession) -> SessionInfo:
        return await self._call("POST", "/sessions", SessionInfo, body=req)  # type: ignore[return-value]

    async def get(self, session_id: str, tenant: str) -> SessionInfo:
        return await self._call(
            "GET",
            self._path(session_id),
            SessionInfo,  # type: ignore[return-value]
            params={"tenant": tenant},
        )

    async def list(self, tenant: str, *, limit: int = 20, after: str | None = None) -> SessionList:
        params: dict[str, Any] = {"tenant": tenant, "limit": limit}
        if after is not None:
            params["after"] = after
        return await self._call("GET", "/sessions", SessionList, params=params)  # type: ignore[return-value]

    async def begin(self, session_id: str, req: BeginTurn) -> SessionState:
        return await self._call(
            "POST",
            self._path(session_id, "/begin"),
            SessionState,  # type: ignore[return-value]
            body=req,
        )

    async def append(self, session_id: str, req: AppendTurn) -> SessionInfo:
        return await self._call(
            "POST",
            self._path(session_id, "/append"),
            SessionInfo,  # type: ignore[return-value]
            body=req,
        )

    async def release(
        self, session_id: str, tenant: str, lock: str, *, record: str | None = None
    ) -> None:
        """Give a lock back; `record`: a claim's (see `ReleaseLock`)."""
        await self._call(
            "POST",
            self._path(session_id, "/release"),
            None,
            body=ReleaseLock(tenant=tenant, lock=lock, record=record),
        )

    async def claim(self, session_id: str, req: ClaimKey) -> Claim:
        return await self._call("POST", self._path(session_id, "/claim"), Claim, body=req)  # type: ignore[return-value]

    async def items(self, session_id: str, req: EditItems) -> ItemsEdited:
        return await self._call("POST", self._path(session_id, "/items"), ItemsEdited, body=req)  # type: ignore[return-value]

    async def renew(self, session_id: str, tenant: str, lock: str) -> bool:
        out = await self._call(
            "POST",
            self._path(session_id, "/renew"),
            LockRenewed,
            body=RenewLock(tenant=tenant, lock=lock),
        )
        assert out is not None
        return out.held

    async def update(self, session_id: str, req: UpdateSession) -> SessionInfo:
        return await self._call("PATCH", self._path(session_id), SessionInfo, body=req)  # type: ignore[return-value]

    async def delete(self, session_id: str, tenant: str) -> None:
        await self._call("DELETE", self._path(session_id), None, params={"tenant": tenant})

    async def get_response(self, session_id: str, tenant: str, response_id: str) -> ResponseRecord:
        return await self._call(
            "GET",
            self._path(session_id, f"/responses/{response_id}"),
            ResponseRecord,  # type: ignore[return-value]
            params={"tenant": tenant},
        )

    async def delete_response(
        self, session_id: str, tenant: str, response_id: str
    ) -> ResponseDeleted:
        return await self._call(
            "DELETE",
            self._path(session_id, f"/responses/{response_id}"),
            ResponseDeleted,  # type: ignore[return-value]
            params={"tenant": tenant},
        )

    async def usage(self, tenant: str) -> TenantUsage:
        return await self._call("GET", f"/tenants/{tenant}/usage", TenantUsage)  # type: ignore[return-value]

    async def rate_take(self, key_id: str, req: RateTake) -> RateWindow:
        """Count a request in an API key's window (`cache_manager/ratelimits.py`)."""
        return await self._call("POST", f"/ratelimits/{key_id}/take", RateWindow, body=req)  # type: ignore[return-value]

    async def rate_settle(self, key_id: str, req: RateSettle) -> None:
        await self._call("POST", f"/ratelimits/{key_id}/settle", None, body=req)

    async def mark_prefixes(self, req: MarkPrefixes) -> None:
        """Name shared prefixes' states (`cache_manager.implicit`)."""
        await self._call("POST", "/implicit/prefixes", None, body=req)

    async def find_implicit(self, req: FindImplicit) -> ImplicitFound:
        """The longest of a request's conversation states the tenant has
        (`cache_manager.implicit`): one store round trip."""
        return await self._call("POST", "/implicit/find", ImplicitFound, body=req)  # type: ignore[return-value]

    async def live_sessions(self) -> int:
        stats = await self._call("GET", "/stats", ManagerStats)
        assert stats is not None
        return stats.live_sessions

    async def health(self) -> bool:
        """Whether the manager and its store answer; raises `ManagerRefused` where the
        manager refuses this gateway's token (it checks a token shown on `/health`)."""
        try:
            await self._call("GET", "/health", None)
        except ManagerRefused:
            raise
        except StoreUnavailable:
            return False
        return True


def _span_of(method: str, path: str) -> tuple[str, dict[str, Any]]:
    """A manager call's span name (its route, ids masked) and attributes (the session)."""
    parts = path.split("/")
    if len(parts) > 2 and parts[1] == "sessions":
        rest = "/".join(["{session_id}", *parts[3:]])
        return f"manager {method} /sessions/{rest}", {tracing.SESSION_ATTR: parts[2]}
    return f"manager {method} {tracing.route_name(path)}", {}


# the in-process calls and the HTTP routes they stand for (span names, as `_span_of`'s)
_LOCAL_OPS = {
    "create": "POST /sessions",
    "get": "GET /sessions/{session_id}",
    "list": "GET /sessions",
    "begin": "POST /sessions/{session_id}/begin",
    "append": "POST /sessions/{session_id}/append",
    "release": "POST /sessions/{session_id}/release",
    "update": "PATCH /sessions/{session_id}",
    "delete": "DELETE /sessions/{session_id}",
    "get_response": "GET /sessions/{session_id}/responses/{id}",
    "delete_response": "DELETE /sessions/{session_id}/responses/{id}",
    "usage": "GET /tenants/{id}/usage",
    "live_sessions": "GET /stats",
    "find_implicit": "POST /implicit/find",
    "mark_prefixes": "POST /implicit/prefixes",
}


def _traced(op: str, call: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """`call` (an in-process manager call) in a span named like the HTTP client's: the
    same trace whether the manager runs here or behind HTTP."""
    by_session = "{session_id}" in op

    @functools.wraps(call)
    async def traced(*args: Any, **kw: Any) -> Any:
        attributes = {tracing.SESSION_ATTR: args[0]} if by_session and args else {}
        with tracing.span(f"manager {op}", attributes):
            return await call(*args, **kw)

    return traced


class LocalManager(ManagerClient):
    """The manager inside this process: `ManagerClient`'s calls on the service itself."""

    def __init__(self, service: SessionService, rate_limits: RateLimitStore) -> None:
        self.service = service
        self.rate_limits = rate_limits
        if tracing.enabled():  # (off: the methods as they are, nothing in between)
            for name, op in _LOCAL_OPS.items():
                setattr(self, name, _traced(op, getattr(self, name)))

    async def aclose(self) -> None:
        return None

    async def create(self, req: CreateSession) -> SessionInfo:
        return await self.service.create(req)

    async def get(self, session_id: str, tenant: str) -> SessionInfo:
        return await self.service.get(session_id, tenant)

    async def list(self, tenant: str, *, limit: int = 20, after: str | None = None) -> SessionList:
        return await self.service.list(tenant, limit, after)

    async def begin(self, session_id: str, req: BeginTurn) -> SessionState:
        return await self.service.begin(session_id, req)

    async def append(self, session_id: str, req: AppendTurn) -> SessionInfo:
        return await self.service.append(session_id, req)

    async def release(
        self, session_id: str, tenant: str, lock: str, *, record: str | None = None
    ) -> None:
        await self.service.release(session_id, tenant, lock, record=record)

    async def claim(self, session_id: str, req: ClaimKey) -> Claim:
        return await self.service.claim(session_id, req)

    async def items(self, session_id: str, req: EditItems) -> ItemsEdited:
        return await self.service.items(session_id, req)

    async def renew(self, session_id: str, tenant: str, lock: str) -> bool:
        return await self.service.renew(session_id, tenant, lock)

    async def update(self, session_id: str, req: UpdateSession) -> SessionInfo:
        return await self.service.update(session_id, req)

    async def delete(self, session_id: str, tenant: str) -> None:
        await self.service.delete(session_id, tenant)

    async def get_response(self, session_id: str, tenant: str, response_id: str) -> ResponseRecord:
        return await self.service.get_response(session_id, tenant, response_id)

    async def delete_response(
        self, session_id: str, tenant: str, response_id: str
    ) -> ResponseDeleted:
        return await self.service.delete_response(session_id, tenant, response_id)

    async def usage(self, tenant: str) -> TenantUsage:
        return await self.service.usage(tenant)

    async def rate_take(self, key_id: str, req: RateTake) -> RateWindow:
        return await self.rate_limits.take(key_id, req)

    async def rate_settle(self, key_id: str, req: RateSettle) -> None:
        await self.rate_limits.settle(key_id, req)

    async def mark_prefixes(self, req: MarkPrefixes) -> None:
        await self.service.mark_prefixes(req)

    async def find_implicit(self, req: FindImplicit) -> ImplicitFound:
        return await self.service.find_implicit(req)

    async def live_sessions(self) -> int:
        return await self.service.live_sessions()

    async def health(self) -> bool:
        try:
            return await self.service.store.ping()
        except StoreUnavailable:
            return False
