"""`POST /v1/chat/completions`: parse, call, shape."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from ctxcache.disconnect import ClientLeft, until_the_client_leaves
from worker.entrypoints.chat_completions.protocol import ChatCompletionRequest
from worker.entrypoints.chat_completions.serving import ChatServing

router = APIRouter()


def get_serving(request: Request) -> ChatServing:
    return ChatServing(request.app.state.worker)


ServingDep = Annotated[ChatServing, Depends(get_serving)]


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest, serving: ServingDep, request: Request
) -> Response | object:
    try:  # a client that leaves cancels the generation (`Generation.events`)
        return await until_the_client_leaves(request.receive, serving.create(body))
    except ClientLeft:
        return Response(status_code=499)  # (nobody reads it)
