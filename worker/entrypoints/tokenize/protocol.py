"""`POST /tokenize` and `POST /detokenize` bodies, as vLLM's."""

from __future__ import annotations

from pydantic import model_validator

from ctxcache.schema import OpenAIBaseModel
from worker.entrypoints.chat_completions.protocol import ChatMessage, ToolFields


class TokenizeRequest(ToolFields):
    """Either `prompt` (text) or `messages` (rendered with the chat template); tools are
    refused, as by the chat endpoint."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        return self


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
