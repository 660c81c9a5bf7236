"""`POST /tokenize`, `POST /detokenize`: parse, call, shape."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from worker.entrypoints.tokenize.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from worker.entrypoints.tokenize.serving import TokenizeServing

router = APIRouter()


def get_serving(request: Request) -> TokenizeServing:
    return TokenizeServing(request.app.state.worker)


ServingDep = Annotated[TokenizeServing, Depends(get_serving)]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, serving: ServingDep) -> TokenizeResponse:
    return serving.tokenize(body)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, serving: ServingDep) -> DetokenizeResponse:
    return serving.detokenize(body)
