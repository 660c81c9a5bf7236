"""`POST /v1/completions`: parse, call, shape."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from worker.entrypoints.completions.protocol import CompletionRequest
from worker.entrypoints.completions.serving import CompletionServing

router = APIRouter()


def get_serving(request: Request) -> CompletionServing:
    return CompletionServing(request.app.state.worker)


ServingDep = Annotated[CompletionServing, Depends(get_serving)]


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, serving: ServingDep) -> Response | object:
    return await serving.create(body)
