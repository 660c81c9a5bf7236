"""Real Redis Cluster and Sentinel topologies on this machine, from the bundled binaries.

For tests and benchmarks (and to try the topologies out): every node is a `RedisServer`
child process on a free port, with its files under one directory. A cluster is created
the way an operator creates one, with `redis-cli --cluster create ... --cluster-replicas`;
a Sentinel setup is a master, a replica and sentinels watching the master. Short failure
timeouts (`node_timeout_ms`, `down_after_ms`) make a failover take seconds, not the
production defaults' tens of seconds.
"""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis
from redis.crc import key_slot
from redis.utils import str_if_bytes

from ctxcache.net import free_port, port_is_free
from ctxcache.redis_server import RedisServer, redis_cli_binary

log = logging.getLogger(__name__)


def _until(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if pred():
                return
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _cluster_port(taken: set[int]) -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    while True:
        port = free_port()
        if port + 10000 <= 65535 and port not in taken and port_is_free(port + 10000):
            taken.add(port)
            return port


def _ask(port: int, *command: str) -> object:
    with redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1) as client:
        return client.execute_command(*command)


def _role(port: int) -> str:
    info = _ask(port, "INFO", "replication")
    assert isinstance(info, dict)
    return str(info["role"])


class RedisClusterServers:
    """`masters` masters with `replicas` replicas each, created with `redis-cli --cluster`."""

    def __init__(
        self, root: Path, *, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000
    ) -> None:
        self.root = Path(root)
        self.masters_wanted = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[RedisServer] = []
        taken: set[int] = set()
        for i in range(masters * (1 + replicas)):
            port = _cluster_port(taken)
            data = self.root / f"node{i}"
            self.nodes.append(
                RedisServer(
                    data,
                    port,
                    extra=[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(data / "nodes.conf"),
                        "--cluster-node-timeout",
                        str(node_timeout_ms),
                    ],
                )
            )

    @property
    def url(self) -> str:
        """Every node is a seed: the client finds the cluster through any live one."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def live(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def start(self, timeout: float = 60.0) -> RedisClusterServers:
        for node in self.nodes:
            node.start()
        subprocess.run(
            [
                redis_cli_binary(),
                "--cluster",
                "create",
                *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=timeout,
        )
        self.wait_ok(timeout)
        log.info("redis cluster on ports %s", [n.port for n in self.nodes])
        return self

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Until every live node says the cluster is ok, with `masters_wanted` masters and
        each of them known as a master by every node (after a failover: the new one)."""

        def ok() -> bool:
            for node in self.live():
                info = str(_ask(node.port, "CLUSTER", "INFO"))
                if "cluster_state:ok" not in info:
                    return False
            return len(self.masters()) == self.masters_wanted

        _until(ok, timeout, "the cluster to be ok")

    def masters(self) -> list[RedisServer]:
        return [n for n in self.live() if _role(n.port) == "master"]

    def master_of(self, key: str) -> RedisServer:
        """The live node that serves the key's slot now."""
        slot = key_slot(key.encode())
        for node in self.live():
            slots = _ask(node.port, "CLUSTER", "SLOTS")
            assert isinstance(slots, list)
            for start, end, primary, *_ in slots:
                if start <= slot <= end:
                    port = int(primary[1])
                    return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"no node serves slot {slot}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class SentinelServer(RedisServer):
    """`redis-server sentinel.conf --sentinel`: a sentinel watching one master."""

    def __init__(self, data_dir: Path, *, service: str, master_port: int, down_after_ms: int):
        super().__init__(data_dir, appendonly=False)
        self.service = service
        self.master_port = master_port
        self.down_after_ms = down_after_ms

    def argv(self) -> list[str]:
        conf = self.data_dir / "sentinel.conf"
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.data_dir}\n"
            f"logfile {self.data_dir / 'sentinel.log'}\n"
            f"sentinel monitor {self.service} 127.0.0.1 {self.master_port} 2\n"
            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
            f"sentinel failover-timeout {self.service} {max(3 * self.down_after_ms, 3000)}\n"
            f"sentinel parallel-syncs {self.service} 1\n"
        )
        return [super().argv()[0], str(conf), "--sentinel"]


class RedisSentinelServers:
    """A master, one replica and `sentinels` sentinels (quorum 2) for `service`."""

    def __init__(
        self,
        root: Path,
        *,
        service: str = "ctxcache",
        sentinels: int = 3,
        down_after_ms: int = 1000,
    ) -> None:
        self.root = Path(root)
        self.service = service
        self.master = RedisServer(self.root / "master")
        self.replica = RedisServer(
            self.root / "replica", extra=["--replicaof", "127.0.0.1", str(self.master.port)]
        )
        self.sentinels = [
            SentinelServer(
                self.root / f"sentinel{i}",
                service=service,
                master_port=self.master.port,
                down_after_ms=down_after_ms,
            )
            for i in range(sentinels)
        ]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}"

    @property
    def servers(self) -> list[RedisServer]:
        return [self.master, self.replica]

    def start(self, timeout: float = 60.0) -> RedisSentinelServers:
        self.master.start()
        self.replica.start()
        _until(self._replica_in_sync, timeout, "the replica to sync")
        for s in self.sentinels:
            s.start()
        self.wait_watching(timeout)
        log.info("sentinels on %s watch %s", [s.port for s in self.sentinels], self.service)
        return self

    def _replica_in_sync(self) -> bool:
        info = _ask(self.replica.port, "INFO", "replication")
        return isinstance(info, dict) and info.get("master_link_status") == "up"

    def wait_watching(self, timeout: float = 60.0) -> None:
        """Until every sentinel sees the master, a replica and the other sentinels (they
        must know each other to elect a leader for a failover)."""

        def watching() -> bool:
            for s in self.sentinels:
                state = _ask(s.port, "SENTINEL", "MASTER", self.service)
                assert isinstance(state, dict)
                fields = {str_if_bytes(k): str_if_bytes(v) for k, v in state.items()}
                others = int(fields["num-other-sentinels"])
                if others < len(self.sentinels) - 1 or int(fields["num-slaves"]) < 1:
                    return False
            return True

        _until(watching, timeout, "the sentinels to watch the master")

    def current_master(self) -> RedisServer:
        """The server the sentinels name as the master now."""
        addr = _ask(self.sentinels[0].port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
        assert isinstance(addr, list)
        port = int(addr[1])
        return next(s for s in self.servers if s.port == port)

    def wait_failover(self, old: RedisServer, timeout: float = 60.0) -> RedisServer:
        """Until every sentinel names another master, and it answers as one."""

        def moved() -> bool:
            for s in self.sentinels:
                addr = _ask(s.port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
                if not isinstance(addr, list) or int(addr[1]) == old.port:
                    return False
            return _role(self.current_master().port) == "master"

        _until(moved, timeout, "the sentinels to fail over")
        return self.current_master()

    def stop(self) -> None:
        for s in [*self.sentinels, self.replica, self.master]:
            s.stop()
