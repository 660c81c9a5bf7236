"""The store's Lua scripts (cache_manager/lua/), and how they go over the wire: several in
one round trip, by EVALSHA, with WAIT for the writes that must reach the replicas."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from redis import exceptions as rexc
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript

from cache_manager.redis_url import StoreRedis

log = logging.getLogger(__name__)

_LUA_DIR = Path(__file__).parent / "lua"


def load_script(redis: StoreRedis, name: str) -> AsyncScript:
    text = (_LUA_DIR / f"{name}.lua").read_text()
    return redis.register_script(text)


Call = tuple[AsyncScript, list[str], list[Any]]


class ScriptRunner:
    """Runs script calls pipelined, for the store's classes that share one connection pool."""

    def __init__(self, redis: StoreRedis, *, wait_replicas: int, wait_timeout_ms: int) -> None:
        self.redis = redis
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms

    async def pipelined(self, *calls: Call, also: Any = None, durable: bool = False) -> list[Any]:
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
