"""The Redis layer: one Lua script per operation, so each is atomic and one round trip.

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
counts, and the tenants are found by a periodic SCAN (`live_sessions`), so a fleet's turns
spread over the cluster's slots with their sessions and tenants.

Every write script is idempotent, so a call retried on a fresh connection after its reply
was lost (a restart, a failover) never writes twice: create finds its own record, begin its
own lock token, append the lock token of the turn it already appended.
"""

from __future__ import annotations

import contextlib
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
from redis import exceptions as rexc
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript

from cache_manager.protocol import Idempotency, Replay, SessionInfo
from cache_manager.redis_url import StoreRedis
from cache_manager.tokens import pack_tokens, unpack_tokens
from ctxcache.errors import (
    IdempotencyKeyReused,
    InvalidRequest,
    QuotaExceeded,
    RequestInProgress,
    SessionBusy,
    SessionNotFound,
    StoreUnavailable,
    VersionConflict,
)
from ctxcache.lmcache_keys import session_key

log = logging.getLogger(__name__)

_LUA_DIR = Path(__file__).parent / "lua"
# A removed session id stays out of its tenant's index this long: a turn's index update
# still on its way must not bring it back (it is sent right after the turn's write, with the
# Redis timeout and one retry, so it lands within seconds or not at all).
KEEP_OUT_MS = 10_000
# A listed id whose record is gone is dropped from the index once it is this old (younger:
# maybe a create in progress, which indexes the id first).
INDEX_GRACE_MS = 60_000
# The tenants the live-session count sums over are found by a SCAN of the tenant indexes at
# most this often (tenants this process has seen are counted at once)
TENANT_SCAN_S = 30.0
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


def _data_keys(session_id: str) -> list[str]:
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


def _script(redis: StoreRedis, name: str) -> AsyncScript:
    text = (_LUA_DIR / f"{name}.lua").read_text()
    return redis.register_script(text)


Call = tuple[AsyncScript, list[str], list[Any]]


def _as_dict(flat: list[bytes]) -> dict[bytes, bytes]:
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
    )


# Redis down, restarting, loading its AOF, or a master failing over: a replica that was a
# master answers READONLY, a cluster CLUSTERDOWN / TRYAGAIN or with a slot nobody serves.
_UNAVAILABLE = (
    rexc.ConnectionError,  # also Sentinel's MasterNotFoundError, and BusyLoadingError
    rexc.TimeoutError,
    rexc.ReadOnlyError,
    rexc.ClusterError,  # also ClusterDownError, MasterDownError, "TTL exhausted"
    rexc.TryAgainError,
    rexc.SlotNotCoveredError,
    OSError,
)


def _unavailable(exc: BaseException) -> bool:
    if isinstance(exc, _UNAVAILABLE):
        return True
    if isinstance(exc, RuntimeError) and "the handler is closed" in str(exc):
        # uvloop's answer to a write on a connection a killed node had just closed (seen
        # when redis-py reconnected to a cluster master killed mid-run)
        return True
    # the cluster client found none of its nodes reachable
    return isinstance(exc, rexc.RedisClusterException) and isinstance(exc.__cause__, _UNAVAILABLE)


# Redis refusing a command it would run another time: memory full under `noeviction` (OOM),
# a failed RDB save with stop-writes-on-bgsave-error (MISCONF), another client's script past
# the busy threshold (BUSY), an ACL user without the right (NOPERM), a demoted master
# (READONLY), too few replicas for min-replicas-to-write (NOREPLICAS), a replica cut off from
# its master (MASTERDOWN). A command of a script gets the same refusal; Redis before 7 wraps
# it ("Error running script (...): @user_script:12: -OOM command not allowed ...") and words
# an ACL refusal inside a script without its code.
_REFUSALS = frozenset(
    ("OOM", "MISCONF", "BUSY", "NOPERM", "READONLY", "NOREPLICAS", "MASTERDOWN", "LOADING")
)
_IN_SCRIPT = re.compile(r": -([A-Z]+) ")
_REFUSAL_CLASSES = {
    rexc.OutOfMemoryError: "OOM",
    rexc.NoPermissionError: "NOPERM",
    rexc.ReadOnlyError: "READONLY",
}


def _refusal(exc: BaseException) -> str | None:
    """The code of a command Redis refused (see `_REFUSALS`), or None."""
    for cls, code in _REFUSAL_CLASSES.items():
        if isinstance(exc, cls):
            return code
    if not isinstance(exc, rexc.ResponseError):
        return None
    text = str(exc)
    first = text.split(" ", 1)[0]
    if first in _REFUSALS:
        return first
    if text.startswith("Error running script"):
        found = _IN_SCRIPT.search(text)
        if found is not None and found.group(1) in _REFUSALS:
            return found.group(1)
        if "The user executing the script can't run this command" in text:
            return "NOPERM"
    return None


@contextlib.asynccontextmanager
async def redis_errors() -> AsyncIterator[None]:
    """Redis unreachable, failing over or refusing the command -> `store_unavailable`
    (503, naming the refusal), never a 500."""
    try:
        yield
    except Exception as exc:
        if _unavailable(exc):
            raise StoreUnavailable(f"session store unavailable: {type(exc).__name__}") from exc
        code = _refusal(exc)
        if code is not None:
            raise StoreUnavailable(f"session store refused the command: {code}") from exc
        raise


def _idempotency_args(idempotency: Idempotency | None) -> list[Any]:
    """request hash, answer, record ttl ms (all '' without a key)."""
    if idempotency is None:
        return ["", "", ""]
    return [idempotency.body, orjson.dumps(idempotency.answer), idempotency.ttl_s * 1000]


def _replay_or_raise(session_id: str, res: list[Any]) -> Replay | None:
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


class SessionStore:
    """Session records in Redis. Every method is one round trip unless it says otherwise."""

    def __init__(
        self, redis: StoreRedis, *, wait_replicas: int = 0, wait_timeout_ms: int = 500
    ) -> None:
        self.redis = redis
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self._create = _script(redis, "create")
        self._begin = _script(redis, "begin")
        self._append = _script(redis, "append")
        self._update = _script(redis, "update")
        self._delete = _script(redis, "delete")
        self._release = _script(redis, "release")
        self._renew = _script(redis, "renew")
        self._claim = _script(redis, "claim")
        self._items = _script(redis, "items")
        self._tenant = _script(redis, "tenant")
        self._response = _script(redis, "response")
        # tenants with an index, for the live-session count: seen here, or found by SCAN
        self._tenants: set[str] = set()
        self._tenants_scanned_at = -TENANT_SCAN_S

    async def _pipelined(self, *calls: Call, also: Any = None, durable: bool = False) -> list[Any]:
        """Several scripts in one round trip (EVALSHA; loaded on the rare NOSCRIPT).

        redis-py's own script-in-pipeline support sends SCRIPT EXISTS before every
        pipeline, a second round trip; this does not. When Redis does not know a script
        yet (first use, a restart, a replica promoted by a failover), only the calls that
        failed on it run again: the others already ran. On a cluster, the calls go to the
        masters of their keys' slots, in one round trip to each.

        `durable`: with `wait_replicas`, the first call's write is answered only once that
        many replicas have it (or `wait_timeout_ms` passed: then it is logged, and answered
        all the same, since it is written), so a failover does not lose it.
        """
        results = await self._send(calls, also, durable)
        missing = [
            i for i, r in enumerate(results[: len(calls)]) if isinstance(r, rexc.NoScriptError)
        ]
        if missing:
            for i in missing:
                await self.redis.script_load(calls[i][0].script)
            again = await self._send([calls[i] for i in missing], None, durable)
            for i, r in zip(missing, again, strict=True):
                results[i] = r
        for r in results:
            if isinstance(r, Exception):
                raise r
        return results

    async def _send(
        self, calls: list[Call] | tuple[Call, ...], also: Any, durable: bool
    ) -> list[Any]:
        pipe = self.redis.pipeline(transaction=False)
        for script, keys, args in calls:
            # the raw command: redis-py's cluster pipeline blocks its `evalsha` method (but
            # routes EVALSHA by its keys; allowed upstream since redis-py PR #4206)
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        if also is not None:  # plain commands riding in the same round trip
            also(pipe)
        wait = durable and self.wait_replicas > 0
        if wait:
            # WAIT counts the writes of its own connection: it rides the same pipeline,
            # to the node that holds the first call's keys
            key = calls[0][1][0]
            target = {}
            if isinstance(self.redis, RedisCluster):
                await self.redis.initialize()  # knows the slots (a no-op once it does)
                target = {"target_nodes": self.redis.get_node_from_key(key)}
            pipe.execute_command("WAIT", self.wait_replicas, self.wait_timeout_ms, **target)
        results: list[Any] = await pipe.execute(raise_on_error=False)
        if wait:
            reached = results.pop()
            if isinstance(reached, int) and reached < self.wait_replicas:
                log.warning(
                    "%s written, but %d of %d replicas confirmed it within %d ms",
                    key,
                    reached,
                    self.wait_replicas,
                    self.wait_timeout_ms,
                )
        return results

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
        args += _idempotency_args(idempotency)
        args += [lock or "", len(fields), *flat]
        args += [orjson.dumps(m) for m in messages]
        keys = [*_data_keys(session_id), session_keys(session_id)[3]]
        if idempotency is not None:
            keys += idempotency_keys(session_id, idempotency)
        async with redis_errors():
            (created,) = await self._pipelined((self._create, keys, args), durable=True)
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
            (res,) = await self._pipelined((self._claim, keys, args), durable=True)
        if res[0] == -5:
            raise IdempotencyKeyReused(
                "the session this Idempotency-Key created still exists, but the key's "
                "record has expired: use a new key"
            )
        if res[0] == -6:
            raise IdempotencyKeyReused(
                "the session this Idempotency-Key created has been deleted: use a new key"
            )
        return _replay_or_raise(session_id, res)

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
                res, counts = await self._pipelined(
                    (self._begin, keys, args),
                    (self._tenant, tenant_keys(tenant), ["status"]),
                )
            else:
                (res,), counts = await self._pipelined((self._begin, keys, args)), None
        if res[0] == 0:
            raise SessionNotFound()
        if res[0] == -1:
            raise SessionBusy(retry_after_ms=max(50, min(int(res[1]), 2000)))
        if res[0] != 1:
            replay = _replay_or_raise(session_id, res)
            assert replay is not None
            return replay
        info = parse_info(session_id, _as_dict(res[1]))
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
            *_idempotency_args(idempotency),
            orjson.dumps(tools) if tools is not None else "",
            "1" if replace else "",
        ]
        args += [orjson.dumps(m) for m in messages]
        keys = session_keys(session_id)
        if idempotency is not None:
            keys = [*keys, *idempotency_keys(session_id, idempotency)]
        async with redis_errors():
            (res,) = await self._pipelined((self._append, keys, args), durable=True)
        if res[0] == 0:
            raise SessionNotFound()
        if res[0] == -1:
            raise SessionBusy()
        if res[0] == -2:
            raise VersionConflict(
                f"expected version {expected_version}, session is at {int(res[1])}"
            )
        rec = _as_dict(res[1])
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
            (held,) = await self._pipelined(
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
            *_idempotency_args(idempotency),
        ]
        args += [orjson.dumps(m) for m in add or []]
        async with redis_errors():
            (res,) = await self._pipelined((self._items, keys, args), durable=True)
        if res[0] == 0:
            raise SessionNotFound()
        if res[0] == -1:
            raise SessionBusy(retry_after_ms=max(50, min(int(res[1]), 2000)))
        if res[0] == -2:
            raise VersionConflict(f"the conversation is at version {int(res[1])}")
        if res[0] != 1:
            replay = _replay_or_raise(session_id, res)
            assert replay is not None
            return replay
        return parse_info(session_id, _as_dict(res[1]))

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
            (res,) = await self._pipelined(
                (self._update, _data_keys(session_id), args), durable=True
            )
        if res[0] == 0:
            raise SessionNotFound()
        return parse_info(session_id, _as_dict(res[1]))

    async def delete(self, session_id: str, tenant: str) -> SessionInfo:
        """Delete, with the session's idempotency records (but a marker of the key that
        created it: see delete.lua); returns the record as it was (its sidecar holds the
        session's KV)."""
        keys = [*session_keys(session_id), records_key(session_id)]
        async with redis_errors():
            (res,) = await self._pipelined((self._delete, keys, [tenant]), durable=True)
        if res[0] == 0:
            raise SessionNotFound()
        return parse_info(session_id, _as_dict(res[1]))

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

    # -- the tenant index -----------------------------------------------------------------
    async def reserve(
        self,
        tenant: str,
        session_id: str,
        *,
        ttl: int,
        tokens: int,
        max_sessions: int,
        max_tokens: int,
    ) -> int:
        """Count a new session against the tenant's quota; returns its expires_at ms."""
        args = ["reserve", session_id, ttl, tokens, max_sessions, max_tokens]
        self._tenants.add(tenant)
        async with redis_errors():
            res = await self._tenant(keys=tenant_keys(tenant), args=args)
        if res[0] == -1:
            raise QuotaExceeded.sessions(int(res[1]))
        if res[0] == -2:
            raise QuotaExceeded.tokens()
        if res[0] == -3:
            raise InvalidRequest("session_id already exists", param="session_id")
        return int(res[1])

    async def record(self, info: SessionInfo, *, exact_expiry: bool = False) -> int:
        """The tenant index learns the session's new state (one write, in the tenant's
        slot). Returns the tenant's total context tokens."""
        args = [
            "record",
            info.session_id,
            info.expires_at * 1000,
            info.version,
            info.context_tokens,
            int(exact_expiry),
        ]
        self._tenants.add(info.tenant)
        async with redis_errors():
            (res,) = await self._pipelined((self._tenant, tenant_keys(info.tenant), args))
        return int(res[1])

    async def unindex(self, tenant: str, session_id: str) -> None:
        """Drop the session from the tenant's index. A turn's index update still on its
        way (`record`, racing a DELETE: the session and the index are in different slots)
        is ignored for KEEP_OUT_MS."""
        async with redis_errors():
            await self._pipelined(
                (self._tenant, tenant_keys(tenant), ["remove", session_id, KEEP_OUT_MS])
            )

    async def _known_tenants(self) -> set[str]:
        """Every tenant with an index: those seen here, and (every TENANT_SCAN_S) those a
        SCAN of the store finds, so sessions made through other managers count too."""
        if time.monotonic() - self._tenants_scanned_at >= TENANT_SCAN_S:
            # on a cluster, redis-py scans every master
            async for key in self.redis.scan_iter(match="tn:{*}:exp", count=10_000, _type="zset"):
                name = key.decode()
                self._tenants.add(name[len("tn:{") : -len("}:exp")])
            self._tenants_scanned_at = time.monotonic()
        return self._tenants

    async def live_sessions(self) -> int:
        """Live sessions of every tenant: each tenant's read-only status, pipelined (on a
        cluster, one round trip to each master). Nothing is written: no key that every
        create or turn would have to write (one slot for the whole fleet) is needed."""
        async with redis_errors():
            tenants = sorted(await self._known_tenants())
            if not tenants:
                return 0
            calls = [(self._tenant, tenant_keys(t), ["status"]) for t in tenants]
            results = await self._pipelined(*calls)
        return sum(int(res[1]) for res in results)

    async def usage(self, tenant: str) -> tuple[int, int]:
        async with redis_errors():
            res = await self._tenant(keys=tenant_keys(tenant), args=["status"])
        return int(res[1]), int(res[2])

    async def list(
        self, tenant: str, *, limit: int, after: str | None
    ) -> tuple[list[SessionInfo], bool]:
        """Newest first; `after` is the last id of the previous page. Two round trips.

        An indexed id whose record is gone (deleted while a turn's late index update put
        it back, or lost with a failover's last writes) is skipped, and dropped from the
        index once it is older than a create in progress could be.
        """
        new_key = tenant_keys(tenant)[1]
        async with redis_errors():
            await self._tenant(keys=tenant_keys(tenant), args=["purge"])  # drop expired ids
            start = 0
            if after is not None:
                rank = await self.redis.zrevrank(new_key, after)
                if rank is None:
                    return [], False
                start = rank + 1
            page = await self.redis.zrevrange(new_key, start, start + limit, withscores=True)
            ids = [(i.decode(), int(created)) for i, created in page]
            pipe = self.redis.pipeline(transaction=False)
            for sid, _ in ids[:limit]:
                pipe.hgetall(session_keys(sid)[0])
            recs = await pipe.execute()
        out, stale = [], []
        old = int(time.time() * 1000) - INDEX_GRACE_MS
        for (sid, created), rec in zip(ids[:limit], recs, strict=True):
            if rec and rec.get(b"tenant", b"").decode() == tenant:
                out.append(parse_info(sid, rec))
            elif created < old:
                stale.append(sid)
        for sid in stale:
            log.info("dropping %s from the index of tenant %s: its record is gone", sid, tenant)
            await self.unindex(tenant, sid)
        return out, len(ids) > limit
