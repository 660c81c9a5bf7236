"""`GET /v1/models`, `GET /health`, `GET /metrics`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from ctxcache.errors import BackendUnavailable
from worker.entrypoints.protocol import ModelCard, ModelList
from worker.entrypoints.serving import WorkerState

router = APIRouter()


def _state(request: Request) -> WorkerState:
    return request.app.state.worker  # type: ignore[no-any-return]


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    state = _state(request)
    card = ModelCard(
        id=state.model_name, root=state.settings.model, max_model_len=state.runner.max_model_len
    )
    return ModelList(data=[card])


@router.get("/health")
async def health(request: Request) -> dict[str, str]:
    if not _state(request).engine.alive:
        raise BackendUnavailable("the engine thread is not running")
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(
        generate_latest(_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST
    )
