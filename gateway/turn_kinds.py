"""A session turn's data and its two kinds: the `Turn` (built whole by the planner, never
changed after), and what differs between a chat turn and a completion turn (`ChatKind`,
`CompletionKind`, behind the `TurnKind` protocol; `KINDS` by name): the body each
refuses, what each tokenizes early and renders, what each sends the engine and appends.
The checks that need nothing but the plan are here too (`check_window`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from cache_manager.protocol import Idempotency, SessionInfo, SessionState
from ctxcache import tracing
from ctxcache.errors import ContextLengthExceeded, InvalidRequest
from ctxcache.lmcache_keys import session_key
from gateway.locks import NO_LOCK, Held
from gateway.pool import Worker
from gateway.prompts import PromptBuilder
from gateway.recent import RecentHistories
from gateway.tools import (
    AGENT_FIELDS,
    LEGACY_FIELDS,
    Tools,
    check_agent_fields,
    check_tool_messages,
    check_tools,
    same_tools,
    uses_chat_engine,
)

if TYPE_CHECKING:
    from gateway.turn_engine import Generation

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class Turn:
    """A planned turn: the whole prompt, and what to append if it succeeds."""

    kind: str  # "chat" or "completion" (`KINDS`)
    model: str
    tenant: str
    prompt: list[int]
    new_tokens: list[int]  # appended before the generated ids
    new_messages: Messages
    history: Messages  # a chat session's messages before this turn
    window: int
    state: SessionState | None = None
    session_id: str | None = None
    worker: Worker | None = None  # where it was planned (the engine may fail over)
    sampling: dict[str, Any] = field(default_factory=dict)
    kv_key: str | None = None  # the tag of the KV blocks; None: the session's own key
    started: float = field(default_factory=time.perf_counter)  # for the end-to-end time
    idempotency: Idempotency | None = None  # the request's key, recorded with the append
    priority: int = 0  # vLLM's scheduling priority (lower first); 0: none sent
    tools: Tools | None = None  # the tools the prompt is rendered with, sent to the engine
    chat_engine: bool = False  # run on the engine's chat endpoint (docs/agents.md)
    new_tools: bool = False  # the session's tools change to `tools` with this turn
    replace: bool = False  # `new_tokens` are the whole history rendered again (new tools)
    lock: Held = NO_LOCK  # the session's turn lock, while the turn runs

    @property
    def append(self) -> bool:
        return self.state is not None and self.state.lock is not None

    @property
    def variant(self) -> TurnKind:
        return KINDS[self.kind]

    @property
    def kv_tag(self) -> str | None:
        if self.kv_key is not None:
            return self.kv_key
        return session_key(self.session_id) if self.session_id is not None else None


def check_window(turn: Turn) -> None:
    """The prompt, and the tokens it may generate, fit the model's window; it is not empty."""
    want = int(turn.sampling.get("max_tokens") or 0)
    if turn.window and len(turn.prompt) + want > turn.window:
        raise ContextLengthExceeded(
            f"this turn needs {len(turn.prompt)} prompt tokens (session context + new "
            f"input) + {want} to generate, over the model's {turn.window}-token window",
            param=turn.variant.param,
        )
    if not turn.prompt:
        raise InvalidRequest("the prompt is empty", param="prompt")


def span_attributes(turn: Turn, worker: Worker | None = None) -> dict[str, Any]:
    """A turn's attributes on its trace spans (generate: where it was planned; commit:
    `worker`, where it ran)."""
    worker = worker or turn.worker
    return {
        tracing.SESSION_ATTR: turn.session_id or "",
        "ctxcache.worker": worker.id if worker is not None else "",
        "ctxcache.prompt_tokens": len(turn.prompt),
    }


# -- the two kinds --------------------------------------------------------------------


class TurnKind(Protocol):
    """What differs between a chat turn and a completion turn."""

    name: str
    route: str  # where its sessions' turns are sent
    messages: bool  # the session keeps messages: its begin loads them
    param: str  # the field a prompt over the model's window is blamed on
    drops: tuple[str, ...]  # fields left out of its request to the engine's completions

    def check(self, body: dict[str, Any]) -> None:
        """What a turn of this kind refuses in its body, before anything is locked."""

    def early(
        self, recent: RecentHistories, session_id: str, body: dict[str, Any]
    ) -> tuple[int | None, Messages] | None:
        """What an early `/tokenize` renders from: (the session version it is for, None:
        any; that version's messages), or None: nothing is tokenized early."""

    def new_messages(self, body: dict[str, Any]) -> Messages: ...

    def new_tools(self, tools: Tools | None, session: Tools | None) -> bool:
        """Whether the session's tools change to `tools` with this turn."""

    def check_fields(self, body: dict[str, Any], tools: Tools | None) -> None: ...

    def check_history(self, history: Messages, new: Messages) -> None: ...

    async def tokenize(
        self,
        prompts: PromptBuilder,
        worker: Worker,
        model: str,
        history: Messages,
        body: dict[str, Any],
        tools: Tools | None,
    ) -> Any:
        """What the turn tokenizes: a completion's new prompt, or the whole chat rendered."""

    async def prompt(
        self,
        prompts: PromptBuilder,
        worker: Worker,
        model: str,
        stored: list[int],
        history: Messages,
        tokenized: Any,
        tools: Tools | None,
    ) -> tuple[list[int], int]:
        """The new ids after `stored` (and the window), from what `tokenize` returned."""

    async def create_prompt(
        self,
        prompts: PromptBuilder,
        worker: Worker,
        model: str,
        new: Messages | str | list[int],
        generate: bool,
        tools: Tools | None,
    ) -> tuple[list[int], int]:
        """A create's whole prompt (`/v1/context`)."""

    def chat_engine(self, body: dict[str, Any], tools: Tools | None) -> bool: ...

    def appended(self, turn: Turn, gen: Generation) -> Messages:
        """The messages a committed turn appends."""

    def remember(
        self, recent: RecentHistories, turn: Turn, info: SessionInfo, messages: Messages
    ) -> None:
        """Keep the history a committed turn left, for the session's next turn."""


class CompletionKind:
    name = "completion"
    route = "/v1/completions"
    messages = False
    param = "prompt"
    drops: tuple[str, ...] = ()

    def check(self, body: dict[str, Any]) -> None:
        check_common(body)
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            raise InvalidRequest("a session turn takes one prompt, not a batch", param="prompt")

    def early(
        self, recent: RecentHistories, session_id: str, body: dict[str, Any]
    ) -> tuple[int | None, Messages] | None:
        # the new text does not depend on the session (ids need no tokenizing)
        return (None, []) if isinstance(body.get("prompt"), str) else None

    def new_messages(self, body: dict[str, Any]) -> Messages:
        return []

    def new_tools(self, tools: Tools | None, session: Tools | None) -> bool:
        return False

    def check_fields(self, body: dict[str, Any], tools: Tools | None) -> None:
        pass

    def check_history(self, history: Messages, new: Messages) -> None:
        pass

    async def tokenize(
        self,
        prompts: PromptBuilder,
        worker: Worker,
        model: str,
        history: Messages,
        body: dict[str, Any],
        tools: Tools | None,
    ) -> Any:
        return await prompts.text(worker, model, body["prompt"], special=False)

    async def prompt(
        self,
        prompts: PromptBuilder,
        worker: Worker,
        model: str,
        stored: list[int],
        history: Messages,
        tokenized: Any,
        tools: Tools | None,
    ) -> tuple[list[int], int]:
        return tokenized  # type: ignore[no-any-return]

    async def create_prompt(
        self,
        prompts: PromptBuilder,
        worker: Worker,
        model: str,
        new: Messages | str | list[int],
        generate: bool,
        tools: Tools | None,
    ) -> tuple[list[int], int]:
        return await prompts.text(worker, model, new, special=True)  # type: ignore[arg-type]

    def chat_engine(self, body: dict[str, Any], tools: Tools | None) -> bool:
        return False

    def appended(self, turn: Turn, gen: Generation) -> Messages:
        return list(turn.new_messages)

    def remember(
        self, recent: RecentHistories, turn: Turn, info: SessionInfo, messages: Messages
    ) -> None:
        pass


class ChatKind:
    name = "chat"
    route = "/v1/chat/completions"
    messages = True
    param = "messages"
    drops = AGENT_FIELDS  # (only empty ones are left on that endpoint: `tools: []`, and such)

    def check(self, body: dict[str, Any]) -> None:
        check_common(body)
        for name in LEGACY_FIELDS:
            if body.get(name) is not None:
                raise InvalidRequest(f"{name} is deprecated: use tools / tool_choice", param=name)
        check_tools(body.get("tools"))

    def early(
        self, recent: RecentHistories, session_id: str, body: dict[str, Any]
    ) -> tuple[int | None, Messages] | None:
        # from the history this gateway saw at the end of the session's previous turn
        return recent.get(session_id)

    def new_messages(self, body: dict[str, Any]) -> Messages:
        return body["messages"]  # type: ignore[no-any-return]

    def new_tools(self, tools: Tools | None, session: Tools | None) -> bool:
        return not same_tools(tools, session)

    def check_fields(self, body: dict[str, Any], tools: Tools | None) -> None:
        check_agent_fields(body, tools)

    def check_history(self, history: Messages, new: Messages) -> None:
        check_tool_messages(history, new)

    async def tokenize(
        self,
        prompts: PromptBuilder,
        worker: Worker,
        model: str,
        history: Messages,
        body: dict[str, Any],
        tools: Tools | None,
    ) -> Any:
        return await prompts.chat_full(worker, model, history, body["messages"], tools)

    async def prompt(
        self,
        prompts: PromptBuilder,
        worker: Worker,
        model: str,
        stored: list[int],
        history: Messages,
        tokenized: Any,
        tools: Tools | None,
    ) -> tuple[list[int], int]:
        return await prompts.delta(worker, model, stored, history, tokenized, tools)

    async def create_prompt(
        self,
        prompts: PromptBuilder,
        worker: Worker,
        model: str,
        new: Messages | str | list[int],
        generate: bool,
        tools: Tools | None,
    ) -> tuple[list[int], int]:
        # prefill only: the conversation so far, closed
        return await prompts.chat(
            worker,
            model,
            new,
            generation_prompt=generate,
            tools=tools,  # type: ignore[arg-type]
        )

    def chat_engine(self, body: dict[str, Any], tools: Tools | None) -> bool:
        return uses_chat_engine(body, tools)

    def appended(self, turn: Turn, gen: Generation) -> Messages:
        return [*turn.new_messages, gen.assistant()]

    def remember(
        self, recent: RecentHistories, turn: Turn, info: SessionInfo, messages: Messages
    ) -> None:
        assert turn.session_id is not None and turn.state is not None
        sid, after = turn.session_id, turn.state.info.version
        if not recent.advance(sid, info.version, messages, info.expires_at, after=after):
            recent.put(sid, info.version, turn.history + messages, info.expires_at)


CHAT, COMPLETION = ChatKind(), CompletionKind()
KINDS: dict[str, TurnKind] = {"chat": CHAT, "completion": COMPLETION}


def check_common(body: dict[str, Any]) -> None:
    if int(body.get("n") or 1) != 1:
        raise InvalidRequest("a session turn generates one choice: n must be 1", param="n")
    if body.get("echo"):
        raise InvalidRequest("echo is not supported on a session turn", param="echo")
