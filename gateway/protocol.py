"""Gateway request and response bodies: OpenAI's, plus the session fields."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from ctxcache.schema import OpenAIBaseModel


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant message's calls
    tool_call_id: str | None = Field(None, max_length=256)  # the call a tool message answers


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


# Booleans and ttl are strict: the services read the raw body, where "false" is truthy.
class SessionFields(OpenAIBaseModel):
    session_id: str | None = Field(None, max_length=256)
    session_append: bool = Field(True, strict=True)


class CompletionBody(SessionFields):
    model: str = Field(min_length=1, max_length=256)
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=128)
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None


class AgentFields(OpenAIBaseModel):
    """Tool calling and structured outputs (checked in detail by gateway/tools.py)."""

    tools: list[dict[str, Any]] | None = Field(None, max_length=512)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = Field(None, strict=True)
    response_format: dict[str, Any] | None = None


class ChatBody(SessionFields, AgentFields):
    model: str = Field(min_length=1, max_length=256)
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=128)
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    logprobs: bool | None = Field(None, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=20)


Metadata = dict[str, str]


def check_metadata(cls: type, v: Metadata | None) -> Metadata | None:
    """OpenAI's metadata limits: 16 pairs, keys <= 64 chars, values <= 512 chars."""
    if v is not None and (len(v) > 16 or any(len(k) > 64 or len(x) > 512 for k, x in v.items())):
        raise ValueError("metadata: at most 16 pairs, keys <= 64 and values <= 512 chars")
    return v


class ContextCreate(AgentFields):
    model: str = Field(min_length=1, max_length=256)
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    ttl: int | None = Field(None, strict=True)
    max_tokens: int = Field(0, ge=0, description="0: prefill only (choices: [])")
    n: int = Field(1, ge=1, le=1, description="a session holds one conversation")
    metadata: Metadata | None = None
    stream: bool = Field(
        False, strict=True, description="stream the answer (max_tokens > 0) as chat does"
    )
    stream_options: StreamOptions | None = None
    reasoning_history: Literal["template", "keep"] = Field(
        "template",
        description="a chat session's past reasoning (docs/reasoning.md): template drops "
        "closed turns' reasoning as the chat template does (re-basing the stored ids once "
        "per closed turn); keep keeps the exact generated ids",
    )

    _metadata = field_validator("metadata")(check_metadata)


class ContextUpdate(OpenAIBaseModel):
    ttl: int = Field(strict=True)


class ContextObject(OpenAIBaseModel):
    session_id: str
    object: Literal["context"] = "context"
    model: str
    created: int
    expires_at: int
    ttl: int
    context_tokens: int
    turns: int
    metadata: dict[str, Any] = Field(default_factory=dict)
    reasoning_history: Literal["template", "keep"] = "template"
    kv_tokens: int | None = Field(
        None,
        description="tokens of KV the sidecar holds for the session (full chunks plus tail "
        "blocks); null in listings and when the sidecar cannot be asked",
    )
    kv_bytes: int | None = Field(None, description="bytes of those blocks")


class ContextList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ContextObject]
    has_more: bool
    first_id: str | None
    last_id: str | None


class ContextDeleted(OpenAIBaseModel):
    session_id: str
    object: Literal["context.deleted"] = "context.deleted"
    deleted: bool = True
    status: Literal["success"] = "success"
