"""`/v1/context`: parse, call, shape."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response

from ctxcache.responses import JSONResponse
from gateway.auth import TenantDep
from gateway.context.service import ContextService
from gateway.idempotency import IdempotencyDep
from gateway.protocol import (
    ContextCreate,
    ContextDeleted,
    ContextList,
    ContextObject,
    ContextUpdate,
)
from gateway.requests import body_doc, read_json


async def get_service(request: Request) -> ContextService:
    return request.app.state.contexts  # type: ignore[no-any-return]


ServiceDep = Annotated[ContextService, Depends(get_service)]
router = APIRouter(prefix="/v1/context")


@router.post("", openapi_extra=body_doc(ContextCreate), response_class=JSONResponse)
async def create(
    request: Request, tenant: TenantDep, svc: ServiceDep, key: IdempotencyDep
) -> Response:
    """Create a session; with `stream: true`, its answer streams as chat's does."""
    raw, body, req = await read_json(request, ContextCreate)
    return await svc.create(tenant, req, body, key(raw))


@router.get("", response_model=ContextList)
async def list_contexts(
    tenant: TenantDep,
    svc: ServiceDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(max_length=256)] = None,
) -> ContextList:
    return await svc.list(tenant, limit, after)


@router.get("/{session_id}", response_model=ContextObject)
async def get(session_id: str, tenant: TenantDep, svc: ServiceDep) -> ContextObject:
    return await svc.get(tenant, session_id)


@router.patch("/{session_id}", response_model=ContextObject)
async def update(
    session_id: str, body: ContextUpdate, tenant: TenantDep, svc: ServiceDep
) -> ContextObject:
    return await svc.update(tenant, session_id, body.ttl)


@router.delete("/{session_id}", response_model=ContextDeleted)
async def delete(session_id: str, tenant: TenantDep, svc: ServiceDep) -> ContextDeleted:
    await svc.delete(tenant, session_id)
    return ContextDeleted(session_id=session_id)
