"""`/v1/responses` and `/v1/conversations` bodies, and the ids that name a point in a session.

Ids carry their session (docs/responses.md): a response id is `resp_` + the 32 characters
of its session id + 16 random ones (the field of the response in `ctx:{<session>}:r`), a
conversation id is `conv_` + its session's 32, an item id is derived from its session and
its place in the conversation. So every lookup goes straight to the session's hash-tag slot
— no pointer key in another slot, nothing to keep consistent across slots.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any, Literal

from pydantic import Field, field_validator

from cache_manager.keys import SESSION_PREFIX, valid_session_id
from ctxcache.schema import OpenAIBaseModel
from gateway.protocol import Metadata, check_metadata
from gateway.responses.items import messages_of

RESPONSE_PREFIX = "resp_"
CONVERSATION_PREFIX = "conv_"
SESSION_BODY = 32  # characters of a session id after its prefix
RESPONSE_TAIL = 16


def new_response_id(session_id: str) -> str:
    tail = secrets.token_urlsafe(12)  # 16 characters
    return RESPONSE_PREFIX + session_id[len(SESSION_PREFIX) :] + tail


def parse_response_id(response_id: str) -> tuple[str, str] | None:
    """`(session id, field in ctx:{id}:r)`, or None for anything we never issued."""
    if not response_id.startswith(RESPONSE_PREFIX):
        return None
    body = response_id[len(RESPONSE_PREFIX) :]
    if len(body) != SESSION_BODY + RESPONSE_TAIL:
        return None
    session_id = SESSION_PREFIX + body[:SESSION_BODY]
    tail = body[SESSION_BODY:]
    if not valid_session_id(session_id) or not _url_safe(tail):
        return None
    return session_id, tail


def _url_safe(s: str) -> bool:
    return s.isascii() and s.replace("-", "").replace("_", "").isalnum()


def conversation_id(session_id: str) -> str:
    return CONVERSATION_PREFIX + session_id[len(SESSION_PREFIX) :]


def parse_conversation_id(conv_id: str) -> str | None:
    if not conv_id.startswith(CONVERSATION_PREFIX):
        return None
    session_id = SESSION_PREFIX + conv_id[len(CONVERSATION_PREFIX) :]
    return session_id if valid_session_id(session_id) else None


def item_id(session_id: str, index: int) -> str:
    """The id of a session's `index`-th message: stable, and the same wherever it is listed."""
    return "msg_" + hashlib.sha256(f"{session_id}:{index}".encode()).hexdigest()[:40]


class ContentPart(OpenAIBaseModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(OpenAIBaseModel):
    """An input item: a message (`type` may be left out, as the SDK's EasyInputMessage)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]

    def as_message(self) -> dict[str, Any]:
        """The message as the session stores and the chat template renders it."""
        if isinstance(self.content, str):
            return {"role": self.role, "content": self.content}
        return {"role": self.role, "content": "".join(p.text for p in self.content)}


class FunctionCallItem(OpenAIBaseModel):
    """A function call the model made (an output item sent back as input)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=64)
    arguments: str


class FunctionCallOutputItem(OpenAIBaseModel):
    """The result of a function call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[ContentPart]


class ReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"]
    text: str


class SummaryText(OpenAIBaseModel):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(OpenAIBaseModel):
    """The model's reasoning, sent back as input (as the Agents SDK does when it sends the
    whole conversation): accepted only as the output it was (`gateway.responses.reasoning`)."""

    type: Literal["reasoning"]
    id: str = Field(min_length=1, max_length=256)
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None

    @property
    def text(self) -> str | None:
        """The reasoning text it carries (None: none sent, as OpenAI's items may omit it)."""
        if not self.content:
            return None
        return "".join(p.text for p in self.content)


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class ReasoningConfig(OpenAIBaseModel):
    """`reasoning`: the effort reaches the chat template (`reasoning_effort`); a summary
    is never written (reasoning items have `summary: []`)."""

    effort: str | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ConversationRef(OpenAIBaseModel):
    id: str = Field(max_length=256)


# Booleans are strict: "false" must not turn into a stored response.
class ResponseCreate(OpenAIBaseModel):
    model: str = Field(min_length=1, max_length=256)
    input: str | list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    previous_response_id: str | None = Field(None, max_length=256)
    conversation: str | ConversationRef | None = None
    store: bool = Field(True, strict=True)
    stream: bool = Field(False, strict=True)
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    metadata: Metadata | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=512)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = Field(None, strict=True)
    text: dict[str, Any] | None = None
    background: bool | None = Field(None, strict=True)
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = Field(None, max_length=64)

    _metadata = field_validator("metadata")(check_metadata)

    @property
    def conversation_id(self) -> str | None:
        if isinstance(self.conversation, ConversationRef):
            return self.conversation.id
        return self.conversation

    def messages(self) -> list[dict[str, Any]]:
        """The input as chat messages (function calls and their outputs included)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return messages_of([i.model_dump(exclude_none=True) for i in self.input])


class ConversationCreate(OpenAIBaseModel):
    items: list[InputMessage] | None = Field(None, max_length=20)
    metadata: Metadata | None = None

    _metadata = field_validator("metadata")(check_metadata)


class ItemsCreate(OpenAIBaseModel):
    """`POST /v1/conversations/{id}/items`: up to 20 items, as OpenAI allows."""

    items: list[InputMessage] = Field(min_length=1, max_length=20)


class ConversationUpdate(OpenAIBaseModel):
    metadata: Metadata

    _metadata = field_validator("metadata")(check_metadata)
