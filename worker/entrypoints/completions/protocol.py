"""`POST /v1/completions` bodies, shaped like vLLM's / OpenAI's."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import Field

from ctxcache.schema import OpenAIBaseModel
from worker.entrypoints.protocol import SamplingFields, UsageInfo


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    suffix: str | None = None


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
