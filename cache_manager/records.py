"""The store's records in and out of the scripts: a session record read as `SessionInfo`; an
idempotency key's record written (its script args) and read back (a `Replay`, or the error
of a key reused or still running)."""

from __future__ import annotations

from typing import Any

import orjson

from cache_manager.protocol import Idempotency, Replay, SessionInfo
from ctxcache.errors import IdempotencyKeyReused, RequestInProgress
from ctxcache.lmcache_keys import session_key


def as_dict(flat: list[bytes]) -> dict[bytes, bytes]:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}


def parse_info(session_id: str, rec: dict[bytes, bytes]) -> SessionInfo:
    def s(key: str) -> str:
        return rec.get(key.encode(), b"").decode()

    def i(key: str) -> int:
        return int(rec.get(key.encode(), b"0"))

    # built from our own record, whose fields have the types parse_info gives them:
    # constructed without a second validation pass (a turn reads it twice)
    return SessionInfo.model_construct(
        session_id=session_id,
        tenant=s("tenant"),
        model=s("model"),
        kind=s("kind"),  # type: ignore[arg-type]
        created=i("created") // 1000,
        last_used=i("last_used") // 1000,
        ttl=i("ttl"),
        expires_at=-(-i("expires_at") // 1000),  # ceil: never report a moment already past
        turns=i("turns"),
        version=i("version"),
        context_tokens=i("context_tokens"),
        affinity=s("affinity") or None,
        sidecar=s("sidecar") or None,
        metadata=orjson.loads(rec.get(b"metadata", b"{}")),
        origin=s("origin") or "context",  # type: ignore[arg-type]
        kv_key=s("kv_key") or session_key(session_id),
        kv_shared=s("kv_shared") == "1",
        edited=i("edited"),
        tools=orjson.loads(rec[b"tools"]) if rec.get(b"tools") else None,
        reasoning_history=s("reasoning_history") or "template",  # type: ignore[arg-type]
    )


def idempotency_args(idempotency: Idempotency | None) -> list[Any]:
    """request hash, answer, record ttl ms (all '' without a key)."""
    if idempotency is None:
        return ["", "", ""]
    return [idempotency.body, orjson.dumps(idempotency.answer), idempotency.ttl_s * 1000]


def replay_or_raise(session_id: str, res: list[Any]) -> Replay | None:
    """The answer of a begin or claim script about an idempotency key."""
    if res[0] == -3:
        raise IdempotencyKeyReused()
    if res[0] == -4:
        raise RequestInProgress(retry_after_ms=max(100, min(int(res[1]), 5000)))
    if res[0] == 2:
        session = {
            "session_id": session_id,
            "context_tokens": int(res[2]),
            "expires_at": -(-int(res[3]) // 1000),
        }
        return Replay(answer=orjson.loads(res[1]), session=session)
    return None
