"""An ambiguous `503 store_unavailable` retried with its `Idempotency-Key`: the Redis master
is killed (SIGKILL) after the turn's append script ran and before the gateway read its
reply, so the client gets a 503 for a turn that was stored. The retry with the same key,
once the store is back (a restart of the one server; on a cluster, its replica promoted),
answers the recorded answer and appends nothing: the session holds the turn once.

The gateway runs in this process (its app, its in-process manager, real Redis, the fault
stack's real workers), so the test can put the kill exactly between the write and the
reply: it wraps the store's `append`, lets the real script run, kills the master, and
raises what the lost reply raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from asgi_lifespan import LifespanManager

from cache_manager.store import SessionStore
from ctxcache.errors import StoreUnavailable
from ctxcache.redis_server import RedisServer
from ctxcache.redis_topologies import RedisClusterServers, RedisSentinelServers
from gateway.app import create_app
from gateway.settings import GatewaySettings, WorkerEndpoint
from tests.faults.conftest import FaultStack

log = logging.getLogger(__name__)
KEY = "fault-key-a"


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisClusterServers]:
    """A cluster per test: each kills a master."""
    servers = RedisClusterServers(tmp_path / "cluster", node_timeout_ms=1000)
    try:
        yield servers.start()
    finally:
        servers.stop()


class LoseTheReply:
    """Wraps a store's `append`: the first call with an idempotency key runs for real, then
    `kill` runs and the call raises as a lost reply does. Keeps what was written."""

    def __init__(self, store: SessionStore, kill: Callable[[str], None]) -> None:
        self.store, self.kill = store, kill
        self.real = store.append
        self.written: dict[str, Any] | None = None
        store.append = self.append  # type: ignore[method-assign]

    async def append(self, session_id: str, tenant: str, **kw: Any) -> Any:
        result = await self.real(session_id, tenant, **kw)
        if self.written is None and kw.get("idempotency") is not None:
            self.written = kw["idempotency"].answer
            log.info("append of %s written; killing the master before its reply", session_id)
            await asyncio.to_thread(self.kill, session_id)
            raise StoreUnavailable("session store unavailable: ConnectionError (reply lost)")
        return result


async def gateway(
    fstack: FaultStack, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    # every acknowledged write is on a replica before it is answered (docs/deploy.md)
    replicated = "cluster" in redis_url or "sentinel" in redis_url
    monkeypatch.setenv("CTX_MANAGER_REDIS_WAIT_REPLICAS", "1" if replicated else "0")
    monkeypatch.setenv("CTX_MANAGER_REDIS_WAIT_TIMEOUT_MS", "300")
    monkeypatch.setenv("CTX_MANAGER_REDIS_TIMEOUT_S", "1.0")
    settings = GatewaySettings(
        redis_url=redis_url,
        workers=[
            WorkerEndpoint(id=f"w{i}", url=w.url, sidecar=fstack.sidecar_url)
            for i, w in enumerate(fstack.workers)
        ],
        api_keys={KEY: "tenant-a"},
        health_interval_s=0.5,
        request_timeout_s=30,
    )
    app = create_app(settings)
    async with LifespanManager(app, startup_timeout=60, shutdown_timeout=30) as manager:
        # an app error after a stream started ends the body (as a server would), not the call
        transport = httpx.ASGITransport(app=manager.app, raise_app_exceptions=False)
        headers = {"authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(
            transport=transport, base_url="http://gw", headers=headers, timeout=60
        ) as http:
            yield http, app


async def until_ok(call: Callable[[], Any], within_s: float = 60) -> httpx.Response:
    """Retry through the outage (503 store_unavailable) until the store answers."""
    deadline = time.monotonic() + within_s
    while True:
        r: httpx.Response = await call()
        if r.status_code != 503 or time.monotonic() > deadline:
            return r
        assert r.json()["error"]["code"] == "store_unavailable"
        await asyncio.sleep(min(int(r.headers.get("retry-after-ms", "250")), 1000) / 1000)


async def lose_a_reply_and_retry(
    http: httpx.AsyncClient, app: Any, kill: Callable[[str], None], *, stream: bool
) -> None:
    r = await until_ok(
        lambda: http.post(
            "/v1/context",
            json={"model": "tiny", "messages": [{"role": "system", "content": "Be brief."}]},
        )
    )
    assert r.status_code == 200, r.text
    sid = r.json()["session_id"]
    before = (await http.get(f"/v1/context/{sid}")).json()
    fault = LoseTheReply(app.state.manager.service.store, kill)
    body: dict[str, Any] = {
        "model": "tiny",
        "session_id": sid,
        "messages": [{"role": "user", "content": "Remember this once."}],
        "max_tokens": 6,
        "temperature": 0,
    }
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    headers = {"Idempotency-Key": f"failover-{sid}"}

    if stream:  # the stream started: its commit failed, so its usage chunk never came
        cut: httpx.Response | None = None
        # a gateway may end a broken stream without its last message, as a server cuts
        # the connection: httpx's ASGI transport then asserts the response completed
        with contextlib.suppress(AssertionError):
            cut = await http.post("/v1/chat/completions", json=body, headers=headers)
        if cut is not None:
            assert cut.status_code == 200 and '"usage"' not in cut.text
    else:
        first = await http.post("/v1/chat/completions", json=body, headers=headers)
        assert first.status_code == 503, first.text
        assert first.json()["error"]["code"] == "store_unavailable"
    assert fault.written is not None, "the turn was not written"

    retry = await until_ok(lambda: http.post("/v1/chat/completions", json=body, headers=headers))
    assert retry.status_code == 200, retry.text
    again = await http.post("/v1/chat/completions", json=body, headers=headers)
    assert again.status_code == 200 and again.text == retry.text
    if stream:
        events = [ln for ln in retry.text.splitlines() if ln.startswith("data: {")]
        assert fault.written["id"] in events[0]
        assert fault.written["choices"][0]["message"]["content"] in retry.text
        assert retry.text.rstrip().endswith("data: [DONE]")
    else:
        answer = retry.json()
        assert {k: answer[k] for k in fault.written} == fault.written  # the recorded answer
        assert answer["session"]["session_id"] == sid

    info = (await until_ok(lambda: http.get(f"/v1/context/{sid}"))).json()
    assert info["turns"] == before["turns"] + 1  # stored once
    state = await app.state.manager.service.store.begin(
        sid, "tenant-a", lock=None, lock_ttl_ms=1000, tokens=False, messages=True, touch=False
    )
    asked = [m["content"] for m in state[2] if m["role"] == "user"]
    assert asked == ["Remember this once."]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_single_redis_killed_between_write_and_reply(
    fstack: FaultStack, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    # acknowledged means in the AOF: with `everysec`, a kill while an fsync is pending
    # loses a write Redis already answered (ctxcache/redis_server.py), so there would be
    # no recorded turn to replay
    redis = RedisServer(tmp_path / "redis", fsync="always").start()

    def kill(_: str) -> None:  # SIGKILL, then the same server back on its AOF
        redis.stop(kill=True)
        redis.start()

    try:
        async for http, app in gateway(fstack, redis.url, monkeypatch):
            await lose_a_reply_and_retry(http, app, kill, stream=stream)
    finally:
        redis.stop()


@pytest.mark.slow  # the single-Redis variant runs in make test (docs/testing.md)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_cluster_master_killed_between_write_and_reply(
    fstack: FaultStack,
    cluster: RedisClusterServers,
    monkeypatch: pytest.MonkeyPatch,
    stream: bool,
) -> None:
    def kill(sid: str) -> None:  # the session's master: its replica takes over
        victim = cluster.master_of(f"ctx:{{{sid}}}")
        log.info("SIGKILL master %d", victim.port)
        victim.stop(kill=True)

    async for http, app in gateway(fstack, cluster.url, monkeypatch):
        await lose_a_reply_and_retry(http, app, kill, stream=stream)
    cluster.wait_ok()


@pytest.mark.slow  # the single-Redis variant runs in make test (docs/testing.md)
async def test_a_sentinel_master_killed_between_write_and_reply(
    fstack: FaultStack, sentinel: RedisSentinelServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = sentinel.current_master()

    def kill(_: str) -> None:  # Sentinel promotes the replica
        log.info("SIGKILL master %d", old.port)
        old.stop(kill=True)

    async for http, app in gateway(fstack, sentinel.url, monkeypatch):
        await lose_a_reply_and_retry(http, app, kill, stream=False)
    assert sentinel.wait_failover(old) is not old
