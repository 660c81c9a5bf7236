"""`POST /v1/chat/completions` bodies, shaped like vLLM's / OpenAI's."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import Field, field_validator

from ctxcache.schema import OpenAIBaseModel
from worker.entrypoints.protocol import SamplingFields, UsageInfo


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]]:
        if v is None:
            return ""
        if isinstance(v, list):
            for part in v:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts are supported")
        return v

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(str(p["text"]) for p in self.content or [])


class ChatTemplateFields(OpenAIBaseModel):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def rendered_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


class ToolFields(OpenAIBaseModel):
    """OpenAI's tool and output-format fields, read only to be refused: the built-in engine
    has no tool parser and no guided decoding (vLLM has both)."""

    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: Any = None

    def unsupported_field(self) -> str | None:
        """The first of these fields the request really uses, or None."""
        if self.tools:
            return "tools"
        if self.tool_choice not in (None, "none"):
            return "tool_choice"
        fmt = self.response_format
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            return "response_format"
        return None


class ChatCompletionRequest(ChatTemplateFields, ToolFields, SamplingFields):
    max_completion_tokens: int | None = Field(None, ge=0)


class AssistantMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(OpenAIBaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None
