"""Session records in Redis: one Lua script per operation, so each is atomic and one round
trip. The keys are named in keys.py, the scripts run by scripts.py; the tenant index
(quotas, listing, counts) is the base class, tenant_index.py.

Every write script is idempotent, so a call retried on a fresh connection after its reply
was lost (a restart, a failover) never writes twice: create finds its own record, begin its
own lock token, append the lock token of the turn it already appended.
"""

from __future__ import annotations

from typing import Any

import orjson

from cache_manager.keys import (
    data_keys,
    idempotency_key,
    idempotency_keys,
    records_key,
    session_keys,
    tenant_keys,
)
from cache_manager.protocol import Idempotency, Replay, SessionInfo
from cache_manager.records import as_dict, idempotency_args, parse_info, replay_or_raise
from cache_manager.redis_url import StoreRedis
from cache_manager.scripts import ScriptRunner, load_script
from cache_manager.store_errors import redis_errors
from cache_manager.tenant_index import TenantIndex
from cache_manager.tokens import pack_tokens, unpack_tokens
from ctxcache.errors import IdempotencyKeyReused, SessionBusy, SessionNotFound, VersionConflict


class SessionStore(TenantIndex):
    """Session records in Redis, and (inherited) their tenants' index. Every method is one
    round trip unless it says otherwise."""

    def __init__(
        self, redis: StoreRedis, *, wait_replicas: int = 0, wait_timeout_ms: int = 500
    ) -> None:
        scripts = ScriptRunner(redis, wait_replicas=wait_replicas, wait_timeout_ms=wait_timeout_ms)
        super().__init__(redis, scripts)
        self._create = load_script(redis, "create")
        self._begin = load_script(redis, "begin")
        self._append = load_script(redis, "append")
        self._update = load_script(redis, "update")
        self._delete = load_script(redis, "delete")
        self._release = load_script(redis, "release")
        self._renew = load_script(redis, "renew")
        self._claim = load_script(redis, "claim")
        self._items = load_script(redis, "items")
        self._response = load_script(redis, "response")

    async def ping(self) -> bool:
        async with redis_errors():
            return bool(await self.redis.ping())

    # -- sessions -------------------------------------------------------------------------
    async def create(
        self,
        session_id: str,
        fields: dict[str, Any],
        expires_at_ms: int,
        tokens: list[int],
        messages: list[dict[str, Any]],
        response: tuple[str, dict[str, Any]] | None = None,
        idempotency: Idempotency | None = None,
        lock: str | None = None,
    ) -> bool:
        """Create; with `idempotency`, its answer is recorded in the same script, and the
        claim's `lock` (`claim`) released."""
        flat: list[Any] = []
        for k, v in fields.items():
            flat += [k, v]
        rid, record = response or ("", None)
        args = [expires_at_ms, pack_tokens(tokens), rid, orjson.dumps(record) if rid else b""]
        args += idempotency_args(idempotency)
        args += [lock or "", len(fields), *flat]
        args += [orjson.dumps(m) for m in messages]
        keys = [*data_keys(session_id), session_keys(session_id)[3]]
        if idempotency is not None:
            keys += idempotency_keys(session_id, idempotency)
        async with redis_errors():
            (created,) = await self._scripts.pipelined((self._create, keys, args), durable=True)
        return bool(created)

    async def claim(
        self, session_id: str, idempotency: Idempotency, *, lock: str, lock_ttl_ms: int
    ) -> Replay | None:
        """Claim an idempotency key for a create of `session_id` (derived from the key):
        None (claimed: `lock` marks the attempt running), or the first attempt's answer."""
        keys = [*session_keys(session_id)[0:1], session_keys(session_id)[3]]
        keys += idempotency_keys(session_id, idempotency)
        args = [idempotency.body, lock, lock_ttl_ms, idempotency.ttl_s * 1000]
        async with redis_errors():
            (res,) = await self._scripts.pipelined((self._claim, keys, args), durable=True)
        if res[0] == -5:
            raise IdempotencyKeyReused(
                "the session this Idempotency-Key created still exists, but the key's "
                "record has expired: use a new key"
            )
        if res[0] == -6:
            raise IdempotencyKeyReused(
                "the session this Idempotency-Key created has been deleted: use a new key"
            )
        return replay_or_raise(session_id, res)

    async def get(self, session_id: str, tenant: str) -> SessionInfo:
        async with redis_errors():
            rec = await self.redis.hgetall(session_keys(session_id)[0])
        if not rec or rec.get(b"tenant", b"").decode() != tenant:
            raise SessionNotFound()
        return parse_info(session_id, rec)

    async def begin(
        self,
        session_id: str,
        tenant: str,
        *,
        lock: str | None,
        lock_ttl_ms: int,
        tokens: bool,
        messages: bool,
        touch: bool,
        usage: bool = True,
        known_version: int = 0,
        idempotency: Idempotency | None = None,
    ) -> tuple[SessionInfo, list[int], list[dict[str, Any]], tuple[int, int] | None] | Replay:
        """Load (and lock) a session — and with `usage` the tenant's usage, pipelined in
        the same round trip. No messages if the session is at `known_version`. With
        `idempotency`: the key's first attempt's answer if it wrote (nothing is loaded or
        locked then), else the key is claimed with the lock."""
        args = [
            tenant,
            lock or "",
            lock_ttl_ms,
            int(tokens),
            int(messages),
            int(touch),
            known_version,
        ]
        keys = session_keys(session_id)
        if idempotency is not None:
            args += [idempotency.body, idempotency.ttl_s * 1000]
            keys = [*keys, *idempotency_keys(session_id, idempotency)]
        async with redis_errors():
            if usage:
                res, counts = await self._scripts.pipelined(
                    (self._begin, keys, args),
                    (self._tenant, tenant_keys(tenant), ["status"]),
                )
            else:
                (res,), counts = await self._scripts.pipelined((self._begin, keys, args)), None
        if res[0] == 0:
            raise SessionNotFound()
        if res[0] == -1:
            raise SessionBusy(retry_after_ms=max(50, min(int(res[1]), 2000)))
        if res[0] != 1:
            replay = replay_or_raise(session_id, res)
            assert replay is not None
            return replay
        info = parse_info(session_id, as_dict(res[1]))
        ids = unpack_tokens(res[2]) if tokens else []
        msgs = [orjson.loads(m) for m in res[3]] if messages else []
        return info, ids, msgs, (int(counts[1]), int(counts[2])) if counts else None

    async def append(
        self,
        session_id: str,
        tenant: str,
        *,
        expected_version: int,
        lock: str | None,
        tokens: list[int],
        messages: list[dict[str, Any]],
        worker: str | None,
        sidecar: str | None,
        model: str | None = None,
        response: tuple[str, dict[str, Any]] | None = None,
        idempotency: Idempotency | None = None,
        tools: list[dict[str, Any]] | None = None,
        replace: bool = False,
    ) -> tuple[SessionInfo, str | None]:
        """CAS append (with the response the turn made, if any, and the answer of its
        idempotency key); returns the new info and the sidecar the session moved away
        from. `tools`: the session's tools from now on (None: kept); `replace`: `tokens`
        are the whole history, rendered again (a turn with other tools)."""
        rid, record = response or ("", None)
        args: list[Any] = [
            tenant,
            expected_version,
            lock or "",
            pack_tokens(tokens),
            len(tokens),
            worker or "",
            sidecar or "",
            model or "",
            rid,
            orjson.dumps(record) if rid else b"",
            *idempotency_args(idempotency),
            orjson.dumps(tools) if tools is not None else "",
            "1" if replace else "",
        ]
        args += [orjson.dumps(m) for m in messages]
        keys = session_keys(session_id)
        if idempotency is not None:
            keys = [*keys, *idempotency_keys(session_id, idempotency)]
        async with redis_errors():
            (res,) = await self._scripts.pipelined((self._append, keys, args), durable=True)
        if res[0] == 0:
            raise SessionNotFound()
        if res[0] == -1:
            raise SessionBusy()
        if res[0] == -2:
            raise VersionConflict(
                f"expected version {expected_version}, session is at {int(res[1])}"
            )
        rec = as_dict(res[1])
        info = parse_info(session_id, rec)
        prev = rec.get(b"prev_sidecar", b"").decode() or None
        moved_from = prev if worker and prev and prev != info.sidecar else None
        return info, moved_from

    async def release(self, session_id: str, lock: str, *, record: str | None = None) -> bool:
        """Release a lock we hold; with `record` (a claim's idempotency key), its record is
        deleted too if the attempt under this lock recorded nothing (it binds nothing)."""
        keys = session_keys(session_id)[3:4]
        if record is not None:
            keys += [idempotency_key(session_id, record), records_key(session_id)]
        async with redis_errors():
            return bool(await self._release(keys=keys, args=[lock]))

    async def renew(self, session_id: str, lock: str, ttl_ms: int) -> bool:
        """Extend a turn lock we hold; False: it is gone (expired, or the session deleted)."""
        async with redis_errors():
            (held,) = await self._scripts.pipelined(
                (self._renew, session_keys(session_id)[3:4], [lock, ttl_ms])
            )
        return bool(held)

    async def items(
        self,
        session_id: str,
        tenant: str,
        *,
        add: list[dict[str, Any]] | None = None,
        delete: int | None = None,
        expected_version: int | None = None,
        idempotency: Idempotency | None = None,
    ) -> SessionInfo | Replay:
        """Add messages to a conversation (`add`) or delete its `delete`-th; its token ids
        are dropped (the next response renders the conversation again). A turn in flight
        is `session_busy`; a version other than `expected_version`, a conflict."""
        keys = session_keys(session_id)[:4]
        if idempotency is not None:
            keys += idempotency_keys(session_id, idempotency)
        args: list[Any] = [
            tenant,
            "add" if add is not None else "delete",
            "" if expected_version is None else expected_version,
            delete or 0,
            *idempotency_args(idempotency),
        ]
        args += [orjson.dumps(m) for m in add or []]
        async with redis_errors():
            (res,) = await self._scripts.pipelined((self._items, keys, args), durable=True)
        if res[0] == 0:
            raise SessionNotFound()
        if res[0] == -1:
            raise SessionBusy(retry_after_ms=max(50, min(int(res[1]), 2000)))
        if res[0] == -2:
            raise VersionConflict(f"the conversation is at version {int(res[1])}")
        if res[0] != 1:
            replay = replay_or_raise(session_id, res)
            assert replay is not None
            return replay
        return parse_info(session_id, as_dict(res[1]))

    async def update(
        self,
        session_id: str,
        tenant: str,
        *,
        ttl: int | None,
        worker: str | None,
        sidecar: str | None,
        metadata: dict[str, Any] | None = None,
        kv_shared: bool = False,
    ) -> SessionInfo:
        args = [
            tenant,
            "" if ttl is None else ttl,
            worker or "",
            sidecar or "",
            b"" if metadata is None else orjson.dumps(metadata),
            int(kv_shared),
        ]
        async with redis_errors():
            (res,) = await self._scripts.pipelined(
                (self._update, data_keys(session_id), args), durable=True
            )
        if res[0] == 0:
            raise SessionNotFound()
        return parse_info(session_id, as_dict(res[1]))

    async def delete(self, session_id: str, tenant: str) -> SessionInfo:
        """Delete, with the session's idempotency records (but a marker of the key that
        created it: see delete.lua); returns the record as it was (its sidecar holds the
        session's KV)."""
        keys = [*session_keys(session_id), records_key(session_id)]
        async with redis_errors():
            (res,) = await self._scripts.pipelined((self._delete, keys, [tenant]), durable=True)
        if res[0] == 0:
            raise SessionNotFound()
        return parse_info(session_id, as_dict(res[1]))

    # -- stored responses -------------------------------------------------------------------
    async def get_response(
        self, session_id: str, tenant: str, response_id: str
    ) -> tuple[dict[str, Any], int] | None:
        """A stored response and the session's version now; None: not found (or not yours)."""
        keys = [session_keys(session_id)[0], session_keys(session_id)[4]]
        async with redis_errors():
            res = await self._response(keys=keys, args=["get", tenant, response_id])
        if res[0] == 0:
            return None
        return orjson.loads(res[1]), int(res[2])

    async def delete_response(self, session_id: str, tenant: str, response_id: str) -> int | None:
        """Delete a stored response; returns how many the session still holds (None: none
        such)."""
        keys = [session_keys(session_id)[0], session_keys(session_id)[4]]
        async with redis_errors():
            res = await self._response(keys=keys, args=["delete", tenant, response_id])
        return int(res[1]) if res[0] == 1 else None
