"""A session turn's data: the planned `Turn`, the engine's `Generation`, and the checks
that need nothing but the request or the plan (a body a turn refuses, a prompt over the
model's window)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from cache_manager.protocol import Idempotency, Replay, SessionState
from ctxcache import tracing
from ctxcache.errors import ContextLengthExceeded, InvalidRequest
from ctxcache.lmcache_keys import session_key
from gateway import metering
from gateway.pool import Worker
from gateway.tools import LEGACY_FIELDS, Tools, assistant_message, check_tools

# gives a turn's lock back, whatever became of it (`TurnService.release_now`)
Release = Callable[[str, SessionState | None], Awaitable[None]]


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: dict[str, Any]
    # from the engine's chat endpoint (a turn with tools, a format, logprobs): the answer's
    # message as the engine parsed it (content, tool_calls, ...) and its logprobs
    message: dict[str, Any] | None = None
    logprobs: Any = None

    def assistant(self) -> dict[str, Any]:
        """The assistant message the history keeps."""
        if self.message is None:
            return {"role": "assistant", "content": self.text}
        return assistant_message(self.message)


@dataclass
class Turn:
    """A planned turn: the whole prompt, and what to append if it succeeds."""

    kind: str
    model: str
    tenant: str
    prompt: list[int]
    new_tokens: list[int]  # appended before the generated ids
    new_messages: list[dict[str, Any]]
    history: list[dict[str, Any]]  # a chat session's messages before this turn
    window: int
    state: SessionState | None = None
    session_id: str | None = None
    worker: Worker | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    kv_key: str | None = None  # the tag of the KV blocks; None: the session's own key
    started: float = field(default_factory=time.perf_counter)  # for the end-to-end time
    idempotency: Idempotency | None = None  # the request's key, recorded with the append
    priority: int = 0  # vLLM's scheduling priority (lower first); 0: none sent
    engine_call: metering.EngineCall | None = None  # its stream's, for the rate limiter
    tools: Tools | None = None  # the tools the prompt is rendered with, sent to the engine
    chat_engine: bool = False  # run on the engine's chat endpoint (docs/agents.md)
    new_tools: bool = False  # the session's tools change to `tools` with this turn
    replace: bool = False  # `new_tokens` are the whole history rendered again (new tools)

    @property
    def append(self) -> bool:
        return self.state is not None and self.state.lock is not None

    @property
    def replay(self) -> Replay | None:
        """The first attempt with this turn's idempotency key wrote: answer what it did."""
        return self.state.replay if self.state is not None else None

    @property
    def kv_tag(self) -> str | None:
        if self.kv_key is not None:
            return self.kv_key
        return session_key(self.session_id) if self.session_id is not None else None


def replayed(
    kind: str, body: dict[str, Any], tenant: str, session_id: str, state: SessionState
) -> Turn:
    """A turn whose idempotency key's first attempt already wrote: nothing to run."""
    return Turn(
        kind=kind,
        model=body["model"],
        tenant=tenant,
        prompt=[],
        new_tokens=[],
        new_messages=[],
        history=[],
        window=0,
        state=state,
        session_id=session_id,
    )


def check_turn_body(kind: str, body: dict[str, Any]) -> None:
    if int(body.get("n") or 1) != 1:
        raise InvalidRequest("a session turn generates one choice: n must be 1", param="n")
    if body.get("echo"):
        raise InvalidRequest("echo is not supported on a session turn", param="echo")
    if kind == "completion":
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            raise InvalidRequest("a session turn takes one prompt, not a batch", param="prompt")
        return
    for name in LEGACY_FIELDS:
        if body.get(name) is not None:
            raise InvalidRequest(f"{name} is deprecated: use tools / tool_choice", param=name)
    check_tools(body.get("tools"))


def check_window(turn: Turn) -> None:
    """The prompt, and the tokens it may generate, fit the model's window; it is not empty."""
    want = int(turn.sampling.get("max_tokens") or 0)
    if turn.window and len(turn.prompt) + want > turn.window:
        raise ContextLengthExceeded(
            f"this turn needs {len(turn.prompt)} prompt tokens (session context + new "
            f"input) + {want} to generate, over the model's {turn.window}-token window",
            param="messages" if turn.kind == "chat" else "prompt",
        )
    if not turn.prompt:
        raise InvalidRequest("the prompt is empty", param="prompt")


def span_attributes(turn: Turn) -> dict[str, Any]:
    """A turn's attributes on its trace spans (generate, commit)."""
    return {
        tracing.SESSION_ATTR: turn.session_id or "",
        "ctxcache.worker": turn.worker.id if turn.worker is not None else "",
        "ctxcache.prompt_tokens": len(turn.prompt),
    }
