"""Session ids and the names of the store's Redis keys.

Key layout (see docs/architecture.md):
    ctx:{<id>}        hash    the session record (tenant, model, ttl, version, ...)
    ctx:{<id>}:t      string  token ids, packed little-endian uint32 (APPEND per turn)
    ctx:{<id>}:m      list    chat messages, one JSON document each
    ctx:{<id>}:lock   string  the turn lock: holder token, PX expiry
    ctx:{<id>}:r      hash    /v1/responses objects made in the session: id -> JSON
    ctx:{<id>}:i:<k>  hash    an Idempotency-Key's record: request hash, running lock or
                              the answer it gave (written by the script that wrote the turn)
    ctx:{<id>}:k      set     the session's idempotency records (deleted with the session)
    tn:{<tenant>}:exp zset    live session ids by expires_at ms (purge + quota count)
    tn:{<tenant>}:new zset    session ids by created ms (listing order)
    tn:{<tenant>}:tok hash    id -> "version:context_tokens"
    tn:{<tenant>}:sum string  the tenant's total context tokens
    tn:{<tenant>}:del zset    ids removed from the index, kept out until a time (ms)
The `{...}` hash tags put a session's keys in one Redis Cluster slot, and a tenant's index
in another; no script touches two slots, so the same code runs on one Redis, on Sentinel
and on a Redis Cluster (redis_url.py). Expiry is Redis' own (PEXPIREAT on every key).
There is no key every session writes: the live-session count is the sum of the tenants'
counts, and the tenants are found by a periodic SCAN (`TenantIndex.live_sessions`), so a
fleet's turns spread over the cluster's slots with their sessions and tenants.
"""

from __future__ import annotations

import secrets

from cache_manager.protocol import Idempotency

SESSION_PREFIX = "ctx_"
_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def new_session_id() -> str:
    """`ctx_` + 192 random bits, URL-safe."""
    return SESSION_PREFIX + secrets.token_urlsafe(24)


def valid_session_id(session_id: str) -> bool:
    body = session_id[len(SESSION_PREFIX) :]
    return session_id.startswith(SESSION_PREFIX) and len(body) == 32 and _ID_CHARS.issuperset(body)


def session_keys(session_id: str) -> list[str]:
    """The record, tokens, messages, turn lock and stored responses: one hash tag, one slot."""
    base = f"ctx:{{{session_id}}}"
    return [base, f"{base}:t", f"{base}:m", f"{base}:lock", f"{base}:r"]


def data_keys(session_id: str) -> list[str]:
    """The keys that live as long as the session: record, tokens, messages, responses."""
    keys = session_keys(session_id)
    return [*keys[:3], keys[4]]


def idempotency_key(session_id: str, key: str) -> str:
    """The record of an idempotency key (a hash of tenant + client key) of a write on the
    session: in the session's slot, so the script that writes the turn writes it too."""
    return f"ctx:{{{session_id}}}:i:{key}"


def records_key(session_id: str) -> str:
    """The set of the session's idempotency records (delete.lua deletes them with it)."""
    return f"ctx:{{{session_id}}}:k"


def idempotency_keys(session_id: str, idempotency: Idempotency) -> list[str]:
    """An idempotency key's record, and the set of the session's records that lists it."""
    return [idempotency_key(session_id, idempotency.key), records_key(session_id)]


def tenant_keys(tenant: str) -> list[str]:
    base = f"tn:{{{tenant}}}"
    return [f"{base}:exp", f"{base}:new", f"{base}:tok", f"{base}:sum", f"{base}:del"]
