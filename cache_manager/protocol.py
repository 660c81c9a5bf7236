"""Bodies of the manager's internal API (gateway <-> manager)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from cache_manager.tokens import TokenIds
from ctxcache.schema import StrictModel

Kind = Literal["chat", "completion"]
# which API made the session: /v1/context, /v1/responses (a chain or a fork of one), or
# /v1/conversations (a named session that only `conversation=` turns append to), or a
# request without a session that resent a conversation (an implicit session, docs/implicit.md)
Origin = Literal["context", "response", "conversation", "implicit"]
# the rule for a chat session's past reasoning (docs/reasoning.md): follow the template
# (closed turns re-based on its rendering) or keep the exact generated ids
ReasoningHistory = Literal["template", "keep"]
Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{32}$")]  # a conversation state's digest


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
    origin: Origin = "context"
    # the tag of the session's KV blocks in the sidecar: its own session key, or the key of
    # the session it was forked from (a fork reads its parent's blocks; docs/responses.md)
    kv_key: str = ""
    kv_shared: bool = False  # a fork reads this session's blocks: a delete leaves them
    # the version of a conversation's last items edit: its token ids were re-rendered then,
    # so a point stored before it is continued from its messages alone
    edited: int = 0
    # the function tools the session's prompt was rendered with (a chat template renders
    # them into the prefix); None: none (docs/agents.md)
    tools: list[dict[str, Any]] | None = None
    reasoning_history: ReasoningHistory = "template"


class Idempotency(StrictModel):
    """A write's `Idempotency-Key`, as the gateway hashed it (docs/limits.md). The record
    `ctx:{<session>}:i:<key>` lives in the session's slot and is written by the script that
    writes the turn (or creates the session), so the outcome and the write are one."""

    key: str = Field(pattern=r"^([0-9a-f]{32})?$", description="hash of tenant + client key")
    body: str = Field(pattern=r"^[0-9a-f]{64}$", description="hash of route + request body")
    ttl_s: int = Field(86_400, ge=1, le=30 * 86_400, description="how long a recorded key lives")
    answer: dict[str, Any] | None = Field(None, description="with a write: the answer it gave")


class Replay(StrictModel):
    """What the first attempt with an idempotency key answered, and its session right after
    its write (`session_id`, `context_tokens`, `expires_at`)."""

    answer: dict[str, Any]
    session: dict[str, Any]


class SessionState(StrictModel):
    """A session loaded for a turn: metadata, history, and the lock token if one was taken
    (held `lock_ttl_ms` unless renewed). `replay`: the key's first attempt already wrote;
    nothing was loaded or locked, answer this."""

    info: SessionInfo
    tokens: TokenIds = Field(default_factory=list)
    messages: list[dict[str, Any]] = Field(default_factory=list)
    lock: str | None = None
    lock_ttl_ms: int | None = None
    replay: Replay | None = None


class ClaimKey(StrictModel):
    """Claim an idempotency key for a create (the session id is derived from the key)."""

    tenant: str = Field(min_length=1, max_length=256)
    idempotency: Idempotency


class Claim(StrictModel):
    """A claimed key: the lock that marks the attempt running (renew it; the create
    releases it) — or the first attempt's answer."""

    lock: str | None = None
    lock_ttl_ms: int | None = None
    replay: Replay | None = None


class EditItems(StrictModel):
    """Add messages to a conversation, or delete one (`delete`: its index, at version
    `expected_version`). The session's token ids are dropped: the next turn renders the
    conversation's messages again."""

    tenant: str
    add: list[dict[str, Any]] | None = Field(None, max_length=20)
    delete: int | None = Field(None, ge=0)
    expected_version: int | None = Field(None, ge=0)
    idempotency: Idempotency | None = None


class ItemsEdited(StrictModel):
    info: SessionInfo | None = None
    replay: Replay | None = None


class RenewLock(StrictModel):
    tenant: str
    lock: str


class LockRenewed(StrictModel):
    held: bool  # false: the lock is gone (expired, or the session deleted)


class StoredResponse(StrictModel):
    """A `/v1/responses` object kept under its session's hash tag (`ctx:{id}:r`), written
    in the same script as the turn that made it."""

    id: str = Field(min_length=1, max_length=64, description="the field in ctx:{id}:r")
    record: dict[str, Any]


class ResponseRecord(StrictModel):
    record: dict[str, Any]
    version: int  # the session's version now (the record says the version it was made at)


class ResponseDeleted(StrictModel):
    remaining: int  # responses the session still holds


class ImplicitPoint(StrictModel):
    """A state of an implicit session: the session right after one of its turns, as a
    stored response's `at` says it (docs/implicit.md)."""

    session_id: str
    version: int = Field(ge=1)
    tokens: int = Field(ge=0)
    messages: int = Field(ge=0)


class ImplicitMark(StrictModel):
    """With a write of an implicit session: the digest its new state is found by (its
    messages, in canonical form, under the request's match key), kept `ttl` seconds."""

    digest: Digest
    messages: int = Field(ge=1, description="the session's messages after the write")
    ttl: int = Field(ge=1, le=30 * 86_400)


class FindImplicit(StrictModel):
    """Which of these states (digests, longest conversation first) the tenant has."""

    tenant: str = Field(min_length=1, max_length=256)
    digests: list[Digest] = Field(min_length=1, max_length=128)


class SharedPrefix(StrictModel):
    """A state of a conversation's prefix another conversation may share (its system
    prompt and tools, a `prompt_cache_breakpoint`): forked, never appended to."""

    digest: Digest
    point: ImplicitPoint
    ttl: int = Field(ge=1, le=30 * 86_400)


class MarkPrefixes(StrictModel):
    tenant: str = Field(min_length=1, max_length=256)
    prefixes: list[SharedPrefix] = Field(min_length=1, max_length=8)


class ImplicitFound(StrictModel):
    index: int = -1  # the first digest found; -1: none
    point: ImplicitPoint | None = None


class CreateSession(StrictModel):
    tenant: str = Field(min_length=1, max_length=256)
    # "": a conversation, which takes the model of its first response (AppendTurn.model)
    model: str = Field(max_length=256)
    kind: Kind
    session_id: str | None = Field(None, description="pre-generated id (new_session_id())")
    tokens: TokenIds = Field(default_factory=list)
    messages: list[dict[str, Any]] = Field(default_factory=list)
    ttl: int | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    worker: str | None = None
    sidecar: str | None = None
    origin: Origin = "context"
    # a session key (`session_key`, 32 hex digits): it travels to the engine as the KV tag
    # `lmcache.tag.s`, inside a cache key of at most 150 bytes (docs/sidecar.md, invariant 5)
    kv_key: str | None = Field(
        None, pattern=r"^([0-9a-f]{32})?$", description="share this KV tag (a fork); None: its own"
    )
    tools: list[dict[str, Any]] | None = Field(None, description="the tools rendered in it")
    reasoning_history: ReasoningHistory = "template"
    response: StoredResponse | None = None
    idempotency: Idempotency | None = None
    lock: str | None = Field(None, description="the claim's lock (ClaimKey), released")
    created_ms: int | None = Field(None, ge=0, description="when (default: now), as answered")
    implicit: ImplicitMark | None = None  # (origin "implicit": its first state)


class BeginTurn(StrictModel):
    tenant: str
    lock: bool = True
    tokens: bool = True
    messages: bool = False
    touch: bool = False
    # with `messages`: the caller already holds the messages of this version; a session still
    # at it returns none (its record's `version` tells the caller which case it is)
    known_version: int = Field(0, ge=0)
    # checked even without a lock (a recorded answer is replayed); claimed with the lock
    idempotency: Idempotency | None = None


class AppendTurn(StrictModel):
    tenant: str
    expected_version: int = Field(ge=0)
    lock: str | None = None
    tokens: TokenIds = Field(default_factory=list)
    messages: list[dict[str, Any]] = Field(default_factory=list)
    worker: str | None = None
    sidecar: str | None = None
    model: str | None = Field(None, description="adopted by a session that has none yet")
    response: StoredResponse | None = None
    idempotency: Idempotency | None = None
    # a turn whose tools differ from the session's: the whole conversation was rendered
    # again with them, and `tokens` replace the session's ids (docs/agents.md)
    tools: list[dict[str, Any]] | None = Field(None, description="the session's tools now")
    replace: bool = Field(False, description="tokens are the whole history, not appended")
    implicit: ImplicitMark | None = None  # an implicit session's new state


class ReleaseLock(StrictModel):
    """Give a lock back; with `record` (a claim's: its idempotency key's hash), the key's
    record goes too unless its attempt recorded an answer (it binds nothing then)."""

    tenant: str
    lock: str
    record: str | None = Field(None, pattern=r"^([0-9a-f]{32})?$")


class UpdateSession(StrictModel):
    tenant: str
    ttl: int | None = None
    worker: str | None = None
    sidecar: str | None = None
    metadata: dict[str, Any] | None = None  # replaces the session's metadata
    kv_shared: bool = False  # a fork now reads the session's KV blocks (never unset)


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
    implicit_sessions: int = 0  # of `sessions`: implicit ones, which give way to a create


class Deleted(StrictModel):
    session_id: str
    deleted: bool = True


class ManagerStats(StrictModel):
    """Counts across every tenant, for metrics (no tenant is named)."""

    live_sessions: int


KeyId = Annotated[str, Field(pattern=r"^[0-9a-f]{16,64}$")]  # `gateway.limits.key_id`


class RateTake(StrictModel):
    """Count one request (and reserve its tokens) in an API key's window, if both fit."""

    window_ms: int = Field(ge=1, le=3_600_000)
    max_requests: int = Field(0, ge=0, le=10**12, description="0: no limit")
    max_tokens: int = Field(0, ge=0, le=10**12, description="0: no limit")
    tokens: int = Field(0, ge=0, le=10**12, description="to reserve")


class RateWindow(StrictModel):
    """The key's window after a take: what it counts, and when it ends."""

    allowed: bool
    requests: int
    tokens: int
    reset_ms: int  # from now until the window ends
    window_end_ms: int  # names the window for `RateSettle`


class RateSettle(StrictModel):
    """A request's real token count replaces its reservation (in the window it was taken;
    if that window has ended, a charge beyond the reservation counts in the current one)."""

    window_end_ms: int = Field(ge=0)
    delta: int = Field(ge=-(10**12), le=10**12, description="used minus reserved")
    window_ms: int = Field(
        0, ge=0, le=3_600_000, description="to open a window for a late charge (0: never)"
    )
