"""Bodies of the manager's internal API (gateway <-> manager)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from cache_manager.tokens import TokenIds
from ctxcache.schema import StrictModel

Kind = Literal["chat", "completion"]


class SessionInfo(StrictModel):
    """A session's metadata: what `GET /v1/context/{id}` shows, never the content."""

    session_id: str
    tenant: str
    model: str
    kind: Kind
    created: int
    last_used: int
    ttl: int
    expires_at: int
    turns: int
    version: int
    context_tokens: int
    affinity: str | None = None
    sidecar: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    kv_tokens: int | None = None  # what the sidecar holds (GET only; None: not asked/unknown)
    kv_bytes: int | None = None


class SessionState(StrictModel):
    """A session loaded for a turn: metadata, history, and the lock token if one was taken."""

    info: SessionInfo
    tokens: TokenIds = Field(default_factory=list)
    messages: list[dict[str, Any]] = Field(default_factory=list)
    lock: str | None = None


class CreateSession(StrictModel):
    tenant: str = Field(min_length=1, max_length=256)
    model: str = Field(min_length=1, max_length=256)
    kind: Kind
    session_id: str | None = Field(None, description="pre-generated id (new_session_id())")
    tokens: TokenIds = Field(default_factory=list)
    messages: list[dict[str, Any]] = Field(default_factory=list)
    ttl: int | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    worker: str | None = None
    sidecar: str | None = None


class BeginTurn(StrictModel):
    tenant: str
    lock: bool = True
    tokens: bool = True
    messages: bool = False
    touch: bool = False
    # with `messages`: the caller already holds the messages of this version; a session still
    # at it returns none (its record's `version` tells the caller which case it is)
    known_version: int = Field(0, ge=0)


class AppendTurn(StrictModel):
    tenant: str
    expected_version: int = Field(ge=0)
    lock: str | None = None
    tokens: TokenIds = Field(default_factory=list)
    messages: list[dict[str, Any]] = Field(default_factory=list)
    worker: str | None = None
    sidecar: str | None = None


class ReleaseLock(StrictModel):
    tenant: str
    lock: str


class UpdateSession(StrictModel):
    tenant: str
    ttl: int | None = None
    worker: str | None = None
    sidecar: str | None = None


class SessionList(StrictModel):
    object: Literal["list"] = "list"
    data: list[SessionInfo]
    has_more: bool
    first_id: str | None
    last_id: str | None


class TenantUsage(StrictModel):
    tenant: str
    sessions: int
    context_tokens: int
    max_sessions: int
    max_context_tokens: int


class Deleted(StrictModel):
    session_id: str
    deleted: bool = True


class ManagerStats(StrictModel):
    """Counts across every tenant, for metrics (no tenant is named)."""

    live_sessions: int
