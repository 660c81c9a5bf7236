"""The manager's internal HTTP API: parse, call the service, shape. No logic here."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from pydantic import BaseModel

from cache_manager.protocol import (
    AppendTurn,
    BeginTurn,
    Claim,
    ClaimKey,
    CreateSession,
    Deleted,
    EditItems,
    FindImplicit,
    ImplicitFound,
    ItemsEdited,
    KeyId,
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


async def get_service(request: Request) -> SessionService:
    return request.app.state.service  # type: ignore[no-any-return]


ServiceDep = Annotated[SessionService, Depends(get_service)]
TenantQ = Annotated[str, Query(min_length=1, max_length=256)]

router = APIRouter(prefix="/sessions")


def _json(model: BaseModel) -> Response:
    """The hot routes answer with the model's own JSON: FastAPI would dump, re-validate and
    re-serialize it (the whole token history, twice) for the same bytes."""
    return Response(model.model_dump_json(), media_type="application/json")


@router.post("", response_model=SessionInfo)
async def create(body: CreateSession, svc: ServiceDep) -> SessionInfo:
    return await svc.create(body)


@router.get("", response_model=SessionList)
async def list_sessions(
    svc: ServiceDep, tenant: TenantQ, limit: int = 20, after: str | None = None
) -> SessionList:
    return await svc.list(tenant, limit, after)


@router.get("/{session_id}", response_model=SessionInfo)
async def get(session_id: str, tenant: TenantQ, svc: ServiceDep) -> Response:
    return _json(await svc.get(session_id, tenant))


@router.post("/{session_id}/begin", response_model=SessionState)
async def begin(session_id: str, body: BeginTurn, svc: ServiceDep) -> Response:
    return _json(await svc.begin(session_id, body))


@router.post("/{session_id}/append", response_model=SessionInfo)
async def append(session_id: str, body: AppendTurn, svc: ServiceDep) -> Response:
    return _json(await svc.append(session_id, body))


@router.post("/{session_id}/release", status_code=204)
async def release(session_id: str, body: ReleaseLock, svc: ServiceDep) -> None:
    await svc.release(session_id, body.tenant, body.lock, record=body.record)


@router.post("/{session_id}/renew", response_model=LockRenewed)
async def renew(session_id: str, body: RenewLock, svc: ServiceDep) -> LockRenewed:
    return LockRenewed(held=await svc.renew(session_id, body.tenant, body.lock))


@router.post("/{session_id}/items", response_model=ItemsEdited)
async def items(session_id: str, body: EditItems, svc: ServiceDep) -> ItemsEdited:
    return await svc.items(session_id, body)


@router.post("/{session_id}/claim", response_model=Claim)
async def claim(session_id: str, body: ClaimKey, svc: ServiceDep) -> Claim:
    return await svc.claim(session_id, body)


@router.patch("/{session_id}", response_model=SessionInfo)
async def update(session_id: str, body: UpdateSession, svc: ServiceDep) -> SessionInfo:
    return await svc.update(session_id, body)


@router.delete("/{session_id}", response_model=Deleted)
async def delete(session_id: str, tenant: TenantQ, svc: ServiceDep) -> Deleted:
    await svc.delete(session_id, tenant)
    return Deleted(session_id=session_id)


ResponseId = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


@router.get("/{session_id}/responses/{response_id}", response_model=ResponseRecord)
async def get_response(
    session_id: str, response_id: ResponseId, tenant: TenantQ, svc: ServiceDep
) -> ResponseRecord:
    return await svc.get_response(session_id, tenant, response_id)


@router.delete("/{session_id}/responses/{response_id}", response_model=ResponseDeleted)
async def delete_response(
    session_id: str, response_id: ResponseId, tenant: TenantQ, svc: ServiceDep
) -> ResponseDeleted:
    return await svc.delete_response(session_id, tenant, response_id)


tenants = APIRouter(prefix="/tenants")
stats = APIRouter()
implicit = APIRouter(prefix="/implicit")


@implicit.post("/prefixes", status_code=204)
async def mark_prefixes(body: MarkPrefixes, svc: ServiceDep) -> None:
    await svc.mark_prefixes(body)


@implicit.post("/find", response_model=ImplicitFound)
async def find_implicit(body: FindImplicit, svc: ServiceDep) -> Response:
    return _json(await svc.find_implicit(body))


@stats.get("/stats", response_model=ManagerStats)
async def get_stats(svc: ServiceDep) -> ManagerStats:
    return ManagerStats(live_sessions=await svc.live_sessions())


@tenants.get("/{tenant}/usage", response_model=TenantUsage)
async def usage(tenant: str, svc: ServiceDep) -> TenantUsage:
    return await svc.usage(tenant)


async def get_rate_limits(request: Request) -> RateLimitStore:
    return request.app.state.rate_limits  # type: ignore[no-any-return]


RateLimitsDep = Annotated[RateLimitStore, Depends(get_rate_limits)]
ratelimits = APIRouter(prefix="/ratelimits")


@ratelimits.post("/{key_id}/take", response_model=RateWindow)
async def rate_take(
    key_id: Annotated[KeyId, Path()], body: RateTake, rl: RateLimitsDep
) -> Response:
    return _json(await rl.take(key_id, body))


@ratelimits.post("/{key_id}/settle", status_code=204)
async def rate_settle(
    key_id: Annotated[KeyId, Path()], body: RateSettle, rl: RateLimitsDep
) -> None:
    await rl.settle(key_id, body)
