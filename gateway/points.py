"""A point in a session's history: the session as it was right after one of its turns
(`at`: its version, token and message counts then). A stored response is one
(`gateway.responses`), a state of an implicit session another (`gateway.implicit`).
Continuing from a point the session has moved past forks it: a new session whose history
is the old one cut at that point, reading its parent's KV blocks.
"""

from __future__ import annotations

import contextlib

from cache_manager.client import ManagerClient
from cache_manager.protocol import Origin, SessionInfo, SessionState, UpdateSession
from ctxcache.errors import SessionNotFound
from ctxcache.lmcache_keys import session_key


def cut(state: SessionState, at: dict[str, int]) -> SessionState:
    """The session as it was right after the point `at` (read-only: no lock). A
    conversation whose items were edited since has other token ids: that point is
    continued from its messages, rendered again."""
    edited = at["version"] < state.info.edited
    return SessionState.model_construct(
        info=state.info,
        tokens=[] if edited else state.tokens[: at["tokens"]],
        messages=state.messages[: at["messages"]],
        lock=None,
    )


def blank(
    session_id: str,
    tenant: str,
    model: str,
    *,
    origin: Origin = "context",
    affinity: str | None = None,
) -> SessionState:
    """A session not created yet: a new chain (or conversation) starts from nothing;
    `affinity`: the worker it should run on, if one is free enough."""
    info = SessionInfo.model_construct(
        session_id=session_id,
        tenant=tenant,
        model=model,
        kind="chat",
        version=0,
        ttl=0,
        affinity=affinity,
        kv_key=session_key(session_id),
        kv_shared=False,
        origin=origin,
        edited=0,
        tools=None,
    )
    return SessionState.model_construct(info=info, tokens=[], messages=[], lock=None)


async def share_kv(manager: ManagerClient, tenant: str, parent: SessionInfo) -> None:
    """A fork reads its parent's KV blocks: mark the parent so that deleting it leaves
    them (they expire with the family's last pin)."""
    if parent.kv_shared or parent.kv_key != session_key(parent.session_id):
        return
    # (deleted meanwhile: its blocks may go, and the fork recomputes them)
    with contextlib.suppress(SessionNotFound):
        await manager.update(parent.session_id, UpdateSession(tenant=tenant, kv_shared=True))
