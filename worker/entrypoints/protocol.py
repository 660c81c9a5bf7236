"""Bodies shared by the completion endpoints: sampling fields, usage, model list."""

from __future__ import annotations

import time
from typing import Any

from pydantic import Field, model_validator

from ctxcache.schema import OpenAIBaseModel


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(OpenAIBaseModel):
    """The OpenAI + vLLM sampling fields both completion endpoints accept."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = False
    kv_transfer_params: dict[str, Any] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    user: str | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> SamplingFields:
        if self.logprobs not in (None, False):
            raise ValueError("logprobs is not supported by this worker")
        if self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0:
            raise ValueError("presence, frequency and repetition penalties are not supported")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this worker")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(s for s in self.stop if s)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ctxcache"
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard]
