"""`/v1/responses`: parse, call, shape."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request, Response

from ctxcache.responses import JSONResponse
from gateway.auth import TenantDep
from gateway.idempotency import IdempotencyDep
from gateway.requests import STREAMS, body_doc
from gateway.responses.protocol import ResponseCreate
from gateway.responses.service import ResponseService
from gateway.responses.shaping import Page


async def get_service(request: Request) -> ResponseService:
    return request.app.state.responses  # type: ignore[no-any-return]


def page_query(
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(max_length=256)] = None,
    order: Annotated[Literal["asc", "desc"], Query()] = "desc",
) -> Page:
    """A list endpoint's `limit`, `after` and `order` (OpenAI's names and defaults)."""
    return Page(limit, after, order)


ServiceDep = Annotated[ResponseService, Depends(get_service)]
PageDep = Annotated[Page, Depends(page_query)]
router = APIRouter(prefix="/v1/responses")


@router.post("", openapi_extra=body_doc(ResponseCreate), responses=STREAMS)
async def create(
    request: Request, tenant: TenantDep, svc: ServiceDep, key: IdempotencyDep
) -> Response:
    return await svc.create(tenant, await request.body(), key)


@router.get("/{response_id}")
async def retrieve(response_id: str, tenant: TenantDep, svc: ServiceDep) -> JSONResponse:
    return JSONResponse(await svc.retrieve(tenant, response_id))


@router.delete("/{response_id}")
async def delete(response_id: str, tenant: TenantDep, svc: ServiceDep) -> JSONResponse:
    return JSONResponse(await svc.delete(tenant, response_id))


@router.get("/{response_id}/input_items")
async def input_items(
    response_id: str, tenant: TenantDep, svc: ServiceDep, page: PageDep
) -> JSONResponse:
    return JSONResponse(await svc.input_items(tenant, response_id, page))
