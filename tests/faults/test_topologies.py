"""The session store on a Redis Cluster (3 masters, 3 replicas, `redis-cli --cluster create`)
and on Sentinel (a master, a replica, 3 sentinels): real servers from the bundled binaries,
behind real gateways in front of this package's workers. Sessions spread over every master;
two gateways share sessions and the turn lock; a killed worker's sessions continue on the
other; a master killed (SIGKILL) mid-run fails over: the turns in flight end in documented
errors, every acknowledged turn is still there, none twice.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
import redis
from redis.cluster import RedisCluster as SyncCluster

from benchmarks.lib.process import Process
from ctxcache.redis_topologies import RedisClusterServers, RedisSentinelServers
from tests.faults.conftest import SYSTEM, Conversation, FaultStack

log = logging.getLogger(__name__)

# every acknowledged write is on a replica too, so a failover cannot lose it (after one, the
# new master has no replica: each write then waits the timeout, and is answered)
DURABLE = {"CTX_MANAGER_REDIS_WAIT_REPLICAS": "1", "CTX_MANAGER_REDIS_WAIT_TIMEOUT_MS": "300"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    servers = RedisClusterServers(tmp_path_factory.mktemp("cluster"), node_timeout_ms=1000)
    try:
        yield servers.start()
    finally:
        servers.stop()


@contextlib.contextmanager
def gateways(
    fstack: FaultStack, redis_url: str, n: int = 1, env: dict[str, str] | None = None
) -> Iterator[list[Process]]:
    started: list[Process] = []
    try:
        for i in range(n):
            name = f"gateway-{int(time.time() * 1000)}-{i}"
            started.append(fstack.start_gateway(redis_url, name, env={**DURABLE, **(env or {})}))
        yield started
    finally:
        for g in started:
            g.stop()


def cluster_client(cluster: RedisClusterServers) -> SyncCluster:
    seed = cluster.live()[0]
    return SyncCluster(host="127.0.0.1", port=seed.port)


def chat_turn(http: httpx.Client, sid: str, question: str, max_tokens: int = 2) -> httpx.Response:
    return http.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "session_id": sid,
        },
    )


def new_chat(http: httpx.Client, tag: str) -> str:
    r = http.post(
        "/v1/context",
        json={"model": "tiny", "messages": [{"role": "system", "content": tag}], "ttl": 600},
    )
    assert r.status_code == 200, r.text
    return str(r.json()["session_id"])


def test_sessions_spread_over_every_master_through_the_gateway(
    fstack: FaultStack, cluster: RedisClusterServers
) -> None:
    masters = {m.port for m in cluster.masters()}
    assert len(masters) == 3
    with (
        gateways(fstack, cluster.url) as (gw,),
        fstack.client("fault-key-b", url=gw.url) as http,
        cluster_client(cluster) as rc,
    ):
        # create until every master holds two sessions' keys
        by_master: dict[int, list[str]] = {port: [] for port in masters}
        for i in range(60):
            if min(len(v) for v in by_master.values()) >= 2:
                break
            sid = new_chat(http, f"Session {i} of the cluster test.")
            by_master[cluster.master_of(f"ctx:{{{sid}}}").port].append(sid)
        assert min(len(v) for v in by_master.values()) >= 2, by_master
        sids = [sid for v in by_master.values() for sid in v]
        for sid in sids:
            r = chat_turn(http, sid, "What is stored?")
            assert r.status_code == 200, r.text
            assert r.json()["session"]["session_id"] == sid
        listed = http.get("/v1/context", params={"limit": 100}).json()
        assert set(sids) <= {s["session_id"] for s in listed["data"]}
        for sid in sids:
            r = http.patch(f"/v1/context/{sid}", json={"ttl": 900})
            assert r.status_code == 200 and r.json()["ttl"] == 900, r.text
            assert r.json()["turns"] == 2
        gone, kept = sids[::2], sids[1::2]
        for sid in gone:
            r = http.delete(f"/v1/context/{sid}")
            assert r.status_code == 200 and r.json()["deleted"] is True, r.text
            assert http.get(f"/v1/context/{sid}").status_code == 404
            assert rc.exists(f"ctx:{{{sid}}}", f"ctx:{{{sid}}}:t", f"ctx:{{{sid}}}:m") == 0
        listed = http.get("/v1/context", params={"limit": 100}).json()
        ids = {s["session_id"] for s in listed["data"]}
        assert set(kept) <= ids and not set(gone) & ids
        # the tenant's index (its own slot) counts exactly the live sessions
        assert rc.zcard("tn:{tenant-b}:exp") == len(ids)
        for sid in kept:
            assert http.delete(f"/v1/context/{sid}").status_code == 200


def test_two_gateways_share_sessions_and_a_dead_worker_hands_them_over(
    fstack: FaultStack, cluster: RedisClusterServers
) -> None:
    with (
        gateways(fstack, cluster.url, n=2) as gws,
        fstack.client(url=gws[0].url) as a,
        fstack.client(url=gws[1].url) as b,
        cluster_client(cluster) as rc,
    ):
        convs = [Conversation(a if i % 2 else b) for i in range(4)]
        for k in range(2):  # turns alternate gateways; each is the recomputed answer
            for conv in convs:
                conv.http = b if conv.http is a else a
                conv.turn(f"Round {k}: which gateway is this?")
        for conv in convs:
            assert conv.info()["turns"] == 3
        # the worker most sessions are affine to dies; its sessions go on on the other
        affine = Counter(rc.hget(f"ctx:{{{c.session_id}}}", "affinity") for c in convs)
        victim = int(affine.most_common(1)[0][0].decode().removeprefix("w"))
        fstack.workers[victim].kill()
        try:
            for k in range(2):
                for conv in convs:
                    conv.http = b if conv.http is a else a
                    conv.turn(f"After the worker died, round {k}?")
            survivor = f"w{1 - victim}".encode()
            for conv in convs:
                assert rc.hget(f"ctx:{{{conv.session_id}}}", "affinity") == survivor
                assert conv.info()["turns"] == 5
        finally:
            fstack.restart_worker(victim)
            fstack.wait_ready_workers(2)


def test_a_gateway_killed_mid_turn_leaves_the_session_usable_after_the_lock_ttl(
    fstack: FaultStack, cluster: RedisClusterServers
) -> None:
    lock_ttl_ms = 6000  # (renewed every 2 s: at least 4 s of it left when the gateway dies)
    with (
        gateways(fstack, cluster.url, n=2, env={"CTX_MANAGER_LOCK_TTL_MS": str(lock_ttl_ms)}) as (
            keep,
            doomed,
        ),
        fstack.client(url=keep.url) as http,
        fstack.client(url=doomed.url) as other,
    ):
        conv = Conversation(http)
        conv.turn("Before the gateway dies?")
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 2000,
            "stream": True,
            "session_id": conv.session_id,
        }
        with other.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            next(r.iter_bytes())  # the turn is running: its lock is taken
            doomed.kill()
        killed_at = time.monotonic()
        # the dead gateway's lock outlives it (measured, not assumed: a loaded machine can
        # take seconds between the kill and the next request)
        client = cluster_client(cluster)
        try:
            left_s = client.pttl(f"ctx:{{{conv.session_id}}}:lock") / 1000
        finally:
            client.close()
        read_at = time.monotonic()
        assert left_s > 0, "the dead gateway's turn lock was gone at once"
        # the other replica sees that lock until it expires; then the session is usable,
        # with nothing of the dead turn appended
        question = "Anyone there?"
        sent = time.monotonic()
        r = chat_turn(http, conv.session_id, question, max_tokens=conv.max_tokens)
        if sent - read_at < left_s - 1.0:  # sent with a second of the lock to spare
            assert r.status_code == 409, r.text
        if r.status_code != 200:
            assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy", r.text
        while r.status_code == 409 and time.monotonic() - killed_at < lock_ttl_ms / 1000 + 10:
            time.sleep(int(r.headers["retry-after-ms"]) / 1000)
            r = chat_turn(http, conv.session_id, question, max_tokens=conv.max_tokens)
        assert r.status_code == 200, r.text
        assert conv.info()["turns"] == 3  # the dead turn appended nothing, this one did
        answer = r.json()["choices"][0]["message"]["content"]
        conv.history += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
        conv.turn("After the lock expired?")


class FailoverRun:
    """Sessions taking chat turns in threads, each question sent once (never retried with
    the same text, so a duplicate would show), through a master's SIGKILL."""

    def __init__(self, http: httpx.Client, sids: list[str]) -> None:
        self.http = http
        self.sids = sids
        self.acked: dict[str, list[str]] = {sid: [] for sid in sids}
        self.failed: dict[str, list[str]] = {sid: [] for sid in sids}
        self.statuses: Counter[str] = Counter()
        self.unexpected: list[str] = []
        self.done = threading.Event()
        self.lock = threading.Lock()

    def drive(self, i: int, sid: str) -> None:
        k = 0
        while not self.done.is_set():
            question = f"Session {i} question {k}."
            k += 1
            try:
                r = chat_turn(self.http, sid, question)
            except httpx.HTTPError as exc:
                self.unexpected.append(f"{question}: {exc!r}")
                continue
            code = r.json().get("error", {}).get("code") if r.status_code != 200 else None
            with self.lock:
                self.statuses[f"{r.status_code} {code or ''}".strip()] += 1
                if r.status_code == 200:
                    self.acked[sid].append(question)
                    continue
                self.failed[sid].append(question)
            documented = (r.status_code, code) in {
                (503, "store_unavailable"),
                (409, "session_busy"),
            }
            if not documented or "retry-after-ms" not in r.headers:
                self.unexpected.append(f"{question}: {r.status_code} {r.text}")
            time.sleep(min(int(r.headers.get("retry-after-ms", "100")), 1000) / 1000)

    def wait_acked(self, want: dict[str, int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while any(len(self.acked[sid]) < n for sid, n in want.items()):
            assert not self.unexpected, self.unexpected
            if time.monotonic() > deadline:
                raise AssertionError(f"turns stalled: {self.statuses}")
            time.sleep(0.1)

    def run(self, kill: Callable[[], None]) -> None:
        threads = [
            threading.Thread(target=self.drive, args=(i, sid), daemon=True)
            for i, sid in enumerate(self.sids)
        ]
        for t in threads:
            t.start()
        try:
            self.wait_acked({sid: 2 for sid in self.sids}, 60)
            before = {sid: len(v) for sid, v in self.acked.items()}
            kill()
            # sessions continue after the failover: two more acknowledged turns each
            self.wait_acked({sid: n + 2 for sid, n in before.items()}, 90)
        finally:
            self.done.set()
            for t in threads:
                t.join(60)  # (a request that hangs times out after 30 s)
        log.info("failover run: %s", dict(self.statuses))
        assert not self.unexpected, self.unexpected
        assert not any(t.is_alive() for t in threads), f"a turn never ended: {self.statuses}"

    def check_history(self, messages: Callable[[str], list[dict[str, Any]]]) -> None:
        """Every acknowledged turn once, in order; a failed one at most once; no other."""
        for sid in self.sids:
            asked = [m["content"] for m in messages(sid) if m["role"] == "user"]
            assert len(asked) == len(set(asked)), f"a turn stored twice: {asked}"
            assert [q for q in asked if q in self.acked[sid]] == self.acked[sid], sid
            assert set(asked) <= set(self.acked[sid]) | set(self.failed[sid])
            info = self.http.get(f"/v1/context/{sid}").json()
            assert info["turns"] == 1 + len(asked)  # the create is turn 1


def failover_run(
    fstack: FaultStack,
    url: str,
    kill: Callable[[list[str]], None],
    messages: Callable[[str], list[dict[str, Any]]],
) -> FailoverRun:
    with gateways(fstack, url) as (gw,), fstack.client(url=gw.url, timeout=30) as http:
        sids = [new_chat(http, f"Failover session {i}. {SYSTEM[:200]}") for i in range(6)]
        run = FailoverRun(http, sids)
        run.run(lambda: kill(sids))
        assert run.statuses["503 store_unavailable"] >= 1, "the kill was not mid-run"
        run.check_history(messages)
        for sid in sids:  # and each session answers like the whole conversation recomputed
            r = turn_when_free(http, sid, "Still consistent?", within_s=10)
            assert r.status_code == 200, (r.text, dict(run.statuses))
        return run


def turn_when_free(http: httpx.Client, sid: str, question: str, within_s: float) -> httpx.Response:
    """A chat turn, retried as a client would while the session is `session_busy`: a turn
    that failed in the last moments of a failover gives its lock back once the store
    answers again (the manager retries the release), which may be just after the run
    ended. `within_s` is well under the lock's TTL (30 s): a lock left to expire fails."""
    deadline = time.monotonic() + within_s
    while True:
        r = chat_turn(http, sid, question)
        busy = r.status_code == 409 and r.json()["error"]["code"] == "session_busy"
        if not busy or time.monotonic() > deadline:
            return r
        time.sleep(int(r.headers["retry-after-ms"]) / 1000)


@pytest.mark.slow  # a configuration of its own (a Cluster, a Sentinel set) failing over
def test_a_cluster_master_killed_mid_run_fails_over_losing_no_acknowledged_turn(
    fstack: FaultStack, cluster: RedisClusterServers
) -> None:
    def kill(sids: list[str]) -> None:
        victim = cluster.master_of(f"ctx:{{{sids[0]}}}")
        log.info("SIGKILL master %d", victim.port)
        victim.stop(kill=True)

    def messages(sid: str) -> list[dict[str, Any]]:
        with cluster_client(cluster) as rc:
            return [orjson.loads(m) for m in rc.lrange(f"ctx:{{{sid}}}:m", 0, -1)]

    failover_run(fstack, cluster.url, kill, messages)
    cluster.wait_ok()  # a replica took over: three masters again


@pytest.mark.slow  # a configuration of its own (a Cluster, a Sentinel set) failing over
def test_a_sentinel_master_killed_mid_run_fails_over_losing_no_acknowledged_turn(
    fstack: FaultStack, sentinel: RedisSentinelServers
) -> None:
    old = sentinel.current_master()

    def kill(sids: list[str]) -> None:
        old.stop(kill=True)

    def messages(sid: str) -> list[dict[str, Any]]:
        with redis.Redis(port=sentinel.current_master().port) as r:
            return [orjson.loads(m) for m in r.lrange(f"ctx:{{{sid}}}:m", 0, -1)]

    failover_run(fstack, sentinel.url, kill, messages)
    assert sentinel.wait_failover(old) is not old
