"""`POST /v1/chat/completions`: parse, call, shape."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from worker.entrypoints.chat_completions.protocol import ChatCompletionRequest
from worker.entrypoints.chat_completions.serving import ChatServing

router = APIRouter()


def get_serving(request: Request) -> ChatServing:
    return ChatServing(request.app.state.worker)


ServingDep = Annotated[ChatServing, Depends(get_serving)]


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest, serving: ServingDep
) -> Response | object:
    return await serving.create(body)
