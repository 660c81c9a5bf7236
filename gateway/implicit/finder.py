"""Finding the state a request continues (docs/implicit.md, "Matching"): the longest of
the request's prefixes that end with an answer whose digest names a state of the tenant's
(one store round trip), then its session, loaded and checked against the request.
`ImplicitSessions` (chat) and the Responses planner both start here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cache_manager.client import ManagerClient
from cache_manager.protocol import BeginTurn, FindImplicit, ImplicitPoint, SessionState
from ctxcache.errors import SessionBusy, SessionNotFound
from gateway.implicit.digests import chain, seed
from gateway.resent import canonical
from gateway.settings import GatewaySettings
from gateway.turns import TurnService

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class MatchKey:
    """What besides the messages two requests must share to share a state."""

    tenant: str
    model: str
    tools: Any = None  # (chat's shape: the tools the prompt renders)
    cache_key: str | None = None  # `prompt_cache_key`
    cache_salt: Any = None  # the client's own `cache_salt`

    def digests(self, messages: Messages) -> list[str | None]:
        start = seed(self.tenant, self.model, self.tools, self.cache_key, self.cache_salt)
        return chain(start, messages)


@dataclass(frozen=True)
class Located:
    """The state a request continues: its first `k` messages are the state's, whose
    session is `state` (locked if it was free)."""

    k: int
    point: ImplicitPoint
    state: SessionState

    @property
    def latest(self) -> bool:
        """The session is still at this state and locked for this turn: it appends (a
        prefix's state, `shared_prefixes`, is never a session's latest: it forks)."""
        return (
            self.state.lock is not None
            and self.state.info.version == self.point.version
            and len(self.state.messages) == self.point.messages
        )

    def at(self) -> dict[str, int]:
        return {
            "version": self.point.version,
            "tokens": self.point.tokens,
            "messages": self.point.messages,
        }


class StateFinder:
    def __init__(self, manager: ManagerClient, turns: TurnService, settings: GatewaySettings):
        self.manager = manager
        self.turns = turns
        self.settings = settings
        self.off_for = frozenset(settings.implicit_off_tenants)

    def on_for(self, tenant: str) -> bool:
        """Whether the deployment and the tenant have implicit sessions on."""
        return self.settings.implicit_sessions and tenant not in self.off_for

    async def locate(
        self,
        tenant: str,
        messages: Messages,
        digests: list[str | None],
        prefixes: list[int] = (),  # type: ignore[assignment]
    ) -> Located | None:
        """The longest state of the conversation the tenant has (of the prefixes that end
        with an answer: the latest `implicit_max_points`; and of `prefixes`, the shared
        prefixes' ends, `shared_prefixes`), and its session; None: none."""
        answers = [
            k
            for k in range(len(messages) - 1, 0, -1)
            if messages[k - 1].get("role") == "assistant" and digests[k - 1] is not None
        ][: self.settings.implicit_max_points]
        shared = [k for k in prefixes if digests[k - 1] is not None and k not in answers]
        ends = sorted({*answers, *shared}, reverse=True)
        if not ends:
            return None
        wanted: list[str] = [digests[k - 1] for k in ends]  # type: ignore[misc]
        got = await self.manager.find_implicit(FindImplicit(tenant=tenant, digests=wanted))
        if got.point is None or got.point.messages != ends[got.index]:
            return None
        k, point = ends[got.index], got.point
        state = await self._load(tenant, point)
        if state is None:
            return None
        if not same(state.messages[:k], messages[:k]):  # (a digest that lied: never trusted)
            await self.turns.give_back(tenant, state)
            return None
        return Located(k, point, state)

    async def _load(self, tenant: str, point: ImplicitPoint) -> SessionState | None:
        """The point's session, locked if free; None if it is gone or no longer holds that
        state (a point is only a hint: its session is the truth)."""
        begin = BeginTurn(tenant=tenant, lock=True, tokens=True, messages=True)
        try:
            try:
                state = await self.manager.begin(point.session_id, begin)
            except SessionBusy:  # a turn in flight on it: this one forks
                begin = begin.model_copy(update={"lock": False})
                state = await self.manager.begin(point.session_id, begin)
        except SessionNotFound:
            return None
        info = state.info
        if (
            info.kind != "chat"
            or info.version < point.version
            or info.edited > point.version
            or len(state.tokens) < point.tokens
            or len(state.messages) < point.messages
        ):
            await self.turns.give_back(tenant, state)
            return None
        return state


def shared_prefixes(messages: Messages, breakpoints: tuple[int, ...] = ()) -> list[int]:
    """Where a conversation's prefix may be another's (docs/implicit.md, "Shared
    prefixes"): after its leading system and developer messages (the system prompt, the
    tools rendered with it), and after each message with a `prompt_cache_breakpoint`
    (`breakpoints`: their indexes); never the whole request."""
    lead = 0
    while lead < len(messages) and messages[lead].get("role") in ("system", "developer"):
        lead += 1
    ends = {lead} if lead else set()
    ends |= {i + 1 for i in breakpoints}
    return sorted(k for k in ends if 0 < k < len(messages))


def same(stored: Messages, sent: Messages) -> bool:
    """Message by message equal in canonical form (`gateway.resent`)."""
    return len(stored) == len(sent) and all(
        canonical(a) == canonical(b) for a, b in zip(stored, sent, strict=True)
    )
