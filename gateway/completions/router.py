"""`POST /v1/completions` and `POST /v1/chat/completions`: parse, call, shape."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response

from gateway.auth import TenantDep
from gateway.completions.service import CompletionService
from gateway.protocol import ChatBody, CompletionBody
from gateway.requests import body_doc


async def get_service(request: Request) -> CompletionService:
    return request.app.state.completions  # type: ignore[no-any-return]


ServiceDep = Annotated[CompletionService, Depends(get_service)]
router = APIRouter(prefix="/v1")
# `stream: true` answers server-sent events, each `data:` a chunk object, then `[DONE]`
STREAMS = {200: {"content": {"text/event-stream": {}}}}


@router.post("/completions", openapi_extra=body_doc(CompletionBody), responses=STREAMS)
async def completions(request: Request, tenant: TenantDep, svc: ServiceDep) -> Response:
    return await svc.answer(
        tenant,
        "completion",
        await request.body(),
        request.headers.get("x-session-id"),
        idempotency_key=request.headers.getlist("idempotency-key") or None,
    )


@router.post("/chat/completions", openapi_extra=body_doc(ChatBody), responses=STREAMS)
async def chat_completions(request: Request, tenant: TenantDep, svc: ServiceDep) -> Response:
    return await svc.answer(
        tenant,
        "chat",
        await request.body(),
        request.headers.get("x-session-id"),
        idempotency_key=request.headers.getlist("idempotency-key") or None,
    )
