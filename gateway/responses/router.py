"""`/v1/responses`: parse, call, shape."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request, Response

from ctxcache.responses import JSONResponse
from gateway.auth import TenantDep
from gateway.completions.router import STREAMS
from gateway.requests import body_doc
from gateway.responses.protocol import ResponseCreate
from gateway.responses.service import ResponseService


async def get_service(request: Request) -> ResponseService:
    return request.app.state.responses  # type: ignore[no-any-return]


ServiceDep = Annotated[ResponseService, Depends(get_service)]
Limit = Annotated[int, Query(ge=1, le=100)]
After = Annotated[str | None, Query(max_length=256)]
Order = Annotated[Literal["asc", "desc"], Query()]
router = APIRouter(prefix="/v1/responses")


@router.post("", openapi_extra=body_doc(ResponseCreate), responses=STREAMS)
async def create(request: Request, tenant: TenantDep, svc: ServiceDep) -> Response:
    return await svc.create(tenant, await request.body())


@router.get("/{response_id}")
async def retrieve(response_id: str, tenant: TenantDep, svc: ServiceDep) -> JSONResponse:
    return JSONResponse(await svc.retrieve(tenant, response_id))


@router.delete("/{response_id}")
async def delete(response_id: str, tenant: TenantDep, svc: ServiceDep) -> JSONResponse:
    return JSONResponse(await svc.delete(tenant, response_id))


@router.get("/{response_id}/input_items")
async def input_items(
    response_id: str,
    tenant: TenantDep,
    svc: ServiceDep,
    limit: Limit = 20,
    after: After = None,
    order: Order = "desc",
) -> JSONResponse:
    page = await svc.input_items(tenant, response_id, after=after, limit=limit, order=order)
    return JSONResponse(page)
