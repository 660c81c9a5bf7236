"""`/v1/conversations`: parse, call, shape."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from ctxcache.responses import JSONResponse
from gateway.auth import TenantDep
from gateway.conversations.service import ConversationService
from gateway.idempotency import IdempotencyDep
from gateway.requests import body_doc, read_json
from gateway.responses.protocol import ConversationCreate, ConversationUpdate, ItemsCreate
from gateway.responses.router import PageDep


async def get_service(request: Request) -> ConversationService:
    return request.app.state.conversations  # type: ignore[no-any-return]


ServiceDep = Annotated[ConversationService, Depends(get_service)]
router = APIRouter(prefix="/v1/conversations")


@router.post("", openapi_extra=body_doc(ConversationCreate))
async def create(
    request: Request, tenant: TenantDep, svc: ServiceDep, key: IdempotencyDep
) -> JSONResponse:
    raw, _, req = await read_json(request, ConversationCreate)
    return await svc.create(tenant, req, key(raw))


@router.get("/{conversation_id}")
async def retrieve(conversation_id: str, tenant: TenantDep, svc: ServiceDep) -> JSONResponse:
    return JSONResponse(await svc.retrieve(tenant, conversation_id))


@router.post("/{conversation_id}", openapi_extra=body_doc(ConversationUpdate))
async def update(
    conversation_id: str, request: Request, tenant: TenantDep, svc: ServiceDep
) -> JSONResponse:
    _, _, req = await read_json(request, ConversationUpdate)
    return JSONResponse(await svc.update(tenant, conversation_id, req.metadata))


@router.delete("/{conversation_id}")
async def delete(conversation_id: str, tenant: TenantDep, svc: ServiceDep) -> JSONResponse:
    return JSONResponse(await svc.delete(tenant, conversation_id))


@router.get("/{conversation_id}/items")
async def items(
    conversation_id: str, tenant: TenantDep, svc: ServiceDep, page: PageDep
) -> JSONResponse:
    return JSONResponse(await svc.items(tenant, conversation_id, page))


@router.post("/{conversation_id}/items", openapi_extra=body_doc(ItemsCreate))
async def add_items(
    conversation_id: str,
    request: Request,
    tenant: TenantDep,
    svc: ServiceDep,
    key: IdempotencyDep,
) -> JSONResponse:
    raw, _, req = await read_json(request, ItemsCreate)
    return await svc.add_items(tenant, conversation_id, req.items, key(raw))


@router.get("/{conversation_id}/items/{item_id}")
async def item(
    conversation_id: str, item_id: str, tenant: TenantDep, svc: ServiceDep
) -> JSONResponse:
    return JSONResponse(await svc.item(tenant, conversation_id, item_id))


@router.delete("/{conversation_id}/items/{item_id}")
async def delete_item(
    conversation_id: str, item_id: str, tenant: TenantDep, svc: ServiceDep
) -> JSONResponse:
    return JSONResponse(await svc.delete_item(tenant, conversation_id, item_id))
