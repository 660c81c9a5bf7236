"""Turning the worker's text completions into what the client asked for."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import orjson

# Fields of ours that never go to a worker.
SESSION_ONLY = ("session_id", "session_append")


def sampling_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The client's generation parameters, to forward with our token-id prompt."""
    drop = {
        *SESSION_ONLY,
        "prompt",
        "messages",
        "stream_options",
        "echo",
        "suffix",
        "max_completion_tokens",
        "return_token_ids",
        "kv_transfer_params",
        # OpenAI's prompt caching: the gateway's to read (`gateway.implicit.fields`)
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
    }
    out = {k: v for k, v in body.items() if k not in drop}
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is None:
        out["max_tokens"] = body["max_completion_tokens"]
    return out


def session_ref(info: Any) -> dict[str, Any]:
    return {
        "session_id": info.session_id,
        "context_tokens": info.context_tokens,
        "expires_at": info.expires_at,
    }


def cached_tokens(usage: dict[str, Any] | None) -> int:
    """vLLM without `--enable-prompt-tokens-details` leaves it out: count it as 0."""
    details = (usage or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def normalize_usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = dict(usage or {})
    usage.setdefault("prompt_tokens", 0)
    usage.setdefault("completion_tokens", 0)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens(usage)}
    return usage


def chat_completion(
    model: str,
    text: str | None,
    finish_reason: str | None,
    usage: dict[str, Any],
    message: dict[str, Any] | None = None,
    logprobs: Any = None,
) -> dict[str, Any]:
    """A `chat.completion` (`text` None: no choice). `message`: the engine's own (with
    `tool_calls` and whatever else its parsers filled in), passed on as it is."""
    choices = (
        []
        if text is None
        else [
            {
                "index": 0,
                "message": message or {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        ]
    )
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def text_completion(
    model: str,
    text: str | None,
    finish_reason: str | None,
    usage: dict[str, Any],
    token_ids: list[int] | None = None,
) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    if text is not None:
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        if token_ids is not None:
            choice["token_ids"] = token_ids
        choices.append(choice)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
    }


DONE = b"data: [DONE]\n\n"


class Shaper(Protocol):
    """What `TurnService.stream` turns the worker's stream into: an event per choice, the
    closing event(s) with usage (and what the commit returned), then `end`. `failed`, if
    the format can end badly by itself (a Responses stream's `response.failed`): the last
    event of a stream whose turn failed after it started; None: such a stream is cut."""

    end: bytes

    @property
    def failed(self) -> Callable[[Exception], bytes] | None: ...

    def start(self) -> bytes: ...

    def content(self, choice: dict[str, Any]) -> bytes: ...

    def usage(self, usage: dict[str, Any], session: dict[str, Any]) -> bytes: ...


class ChunkShaper:
    """Re-shapes a worker's text-completion stream into the client's stream format."""

    end = DONE
    failed = None  # (a stream that fails is cut: `gateway.completions.streams`)

    def __init__(self, kind: str, model: str, want_token_ids: bool) -> None:
        self.kind = kind
        self.model = model
        self.want_token_ids = want_token_ids
        self.id = f"chatcmpl-{uuid.uuid4().hex}" if kind == "chat" else f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.started = False

    def start(self) -> bytes:
        return b""  # the first chunk carries the role

    def content(self, choice: dict[str, Any]) -> bytes:
        """One event of the answer from one choice of the worker's: a completion's text, or
        (from the engine's chat endpoint) a chat delta passed on as it is."""
        if self.kind == "chat":
            delta: dict[str, Any] = choice.get("delta") or {"content": choice.get("text", "")}
            if not self.started:
                delta = {"role": "assistant", **delta}
            out_choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": choice.get("logprobs"),
                "finish_reason": choice.get("finish_reason"),
            }
            obj = "chat.completion.chunk"
        else:
            out_choice = {
                "index": 0,
                "text": choice.get("text", ""),
                "logprobs": None,
                "finish_reason": choice.get("finish_reason"),
            }
            if self.want_token_ids and choice.get("token_ids") is not None:
                out_choice["token_ids"] = choice["token_ids"]
            obj = "text_completion"
        self.started = True
        return self._event(
            {
                "id": self.id,
                "object": obj,
                "created": self.created,
                "model": self.model,
                "choices": [out_choice],
            }
        )

    def usage(self, usage: dict[str, Any], session: dict[str, Any]) -> bytes:
        """The final usage chunk, with the session (none: an implicit session's, which the
        client never named, `gateway.implicit`)."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        event: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        }
        if session:
            event.update(session=session, session_id=session["session_id"])
        return self._event(event)

    @staticmethod
    def _event(payload: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(payload) + b"\n\n"
