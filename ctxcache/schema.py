"""The one schema base and OpenAI error envelope shared by gateway, manager and worker."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class OpenAIBaseModel(BaseModel):
    """Base of every request/response body: unknown fields are kept, like vLLM's."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class StrictModel(BaseModel):
    """Base of internal bodies (manager, sidecar control): unknown fields are an error."""

    model_config = ConfigDict(extra="forbid")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """`{"error": {"message", "type", "param", "code"}}`, the OpenAI envelope."""

    error: ErrorInfo
