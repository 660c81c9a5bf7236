"""`POST /v1/completions`: parse, call, shape."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from ctxcache.disconnect import ClientLeft, until_the_client_leaves
from worker.entrypoints.completions.protocol import CompletionRequest
from worker.entrypoints.completions.serving import CompletionServing

router = APIRouter()


def get_serving(request: Request) -> CompletionServing:
    return CompletionServing(request.app.state.worker)


ServingDep = Annotated[CompletionServing, Depends(get_serving)]


@router.post("/v1/completions", response_model=None)
async def create_completion(
    body: CompletionRequest, serving: ServingDep, request: Request
) -> Response | object:
    try:  # a client that leaves cancels the generation (`Generation.events`)
        return await until_the_client_leaves(request.receive, serving.create(body))
    except ClientLeft:
        return Response(status_code=499)  # (nobody reads it)
