"""What differs between a chat turn and a completion turn: `ChatKind` and
`CompletionKind`, behind the `TurnKind` protocol (`KINDS` by name). The planner asks a
turn's kind what the body may not hold, what to tokenize early and render, what to check
and leave out of the engine request; the commit asks it what to append and remember. The
`Turn` itself is the planner's (`gateway.turn_planning`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from cache_manager.protocol import SessionInfo
from ctxcache.errors import InvalidRequest
from gateway.pool import Worker
from gateway.prompts import PromptBuilder
from gateway.reasoning import TEMPLATE_FIELDS, template_kwargs
from gateway.recent import RecentHistories
from gateway.resent import held
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
    from gateway.turn_planning import Turn

Messages = list[dict[str, Any]]


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

    def unsent(self, body: dict[str, Any], history: Messages) -> dict[str, Any]:
        """The body without what of its messages the session already holds (a chat turn
        that resends the history, `gateway.resent`); `body` itself if nothing is."""

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
        kwargs: dict[str, Any] | None = None,
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
        kwargs: dict[str, Any] | None = None,
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

    def unsent(self, body: dict[str, Any], history: Messages) -> dict[str, Any]:
        return body

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
        kwargs: dict[str, Any] | None = None,
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
        kwargs: dict[str, Any] | None = None,
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
    # (only empty ones are left on that endpoint: `tools: []`, and such; the template's
    # kwargs were the rendering's)
    drops = (*AGENT_FIELDS, *TEMPLATE_FIELDS)

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

    def unsent(self, body: dict[str, Any], history: Messages) -> dict[str, Any]:
        n = held(history, body["messages"])
        return {**body, "messages": body["messages"][n:]} if n else body

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
        kwargs = template_kwargs(body)
        return await prompts.chat_full(worker, model, history, body["messages"], tools, kwargs)

    async def prompt(
        self,
        prompts: PromptBuilder,
        worker: Worker,
        model: str,
        stored: list[int],
        history: Messages,
        tokenized: Any,
        tools: Tools | None,
        kwargs: dict[str, Any] | None = None,
    ) -> tuple[list[int], int]:
        return await prompts.delta(worker, model, stored, history, tokenized, tools, kwargs)

    async def create_prompt(
        self,
        prompts: PromptBuilder,
        worker: Worker,
        model: str,
        new: Messages | str | list[int],
        generate: bool,
        tools: Tools | None,
        kwargs: dict[str, Any] | None = None,
    ) -> tuple[list[int], int]:
        # prefill only: the conversation so far, closed
        return await prompts.chat(
            worker,
            model,
            new,  # type: ignore[arg-type]
            generation_prompt=generate,
            tools=tools,
            kwargs=kwargs,
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
