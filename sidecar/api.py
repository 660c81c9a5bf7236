"""Control API routes: session pins, stats, metrics, health."""

from __future__ import annotations

import hmac
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from pydantic import Field

from ctxcache.errors import InvalidAPIKey
from ctxcache.schema import StrictModel
from sidecar.service import Sidecar


class PinRequest(StrictModel):
    expires_at: float = Field(description="unix seconds; the pin ends then")


class SessionInfo(StrictModel):
    session: str
    blocks: int
    bytes: int
    tokens: int = Field(description="tokens of KV in the session's blocks")
    pinned: bool
    expires_at: float | None


class DropResult(StrictModel):
    session: str
    deleted: bool
    blocks: int
    bytes: int


def get_sidecar(request: Request) -> Sidecar:
    return request.app.state.sidecar  # type: ignore[no-any-return]


SidecarDep = Annotated[Sidecar, Depends(get_sidecar)]


def require_token(request: Request, sidecar: SidecarDep) -> None:
    token = sidecar.settings.token
    if token is None:
        return
    given = request.headers.get("authorization", "")
    expected = f"Bearer {token.get_secret_value()}"
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise InvalidAPIKey("missing or invalid bearer token for the sidecar control API")


open_router = APIRouter()
router = APIRouter(dependencies=[Depends(require_token)])


@open_router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.put("/sessions/{key}", response_model=SessionInfo)
async def pin_session(key: str, body: PinRequest, sidecar: SidecarDep) -> dict[str, Any]:
    sidecar.store.pin(key, body.expires_at)
    return sidecar.store.session_info(key)


@router.get("/sessions/{key}", response_model=SessionInfo)
async def session_info(key: str, sidecar: SidecarDep) -> dict[str, Any]:
    return sidecar.store.session_info(key)


@router.delete("/sessions/{key}", response_model=DropResult)
async def drop_session(key: str, sidecar: SidecarDep) -> DropResult:
    blocks, nbytes = sidecar.store.drop_session(key)
    return DropResult(session=key, deleted=True, blocks=blocks, bytes=nbytes)


@router.get("/stats")
async def stats(sidecar: SidecarDep) -> dict[str, Any]:
    return sidecar.store.stats()


@router.get("/metrics")
async def metrics(sidecar: SidecarDep) -> Response:
    body = sidecar.metrics.render(sidecar.store.stats)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")
