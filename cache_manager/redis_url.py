"""The session store's Redis, chosen by the URL's scheme: one server, a Cluster or Sentinel.

    redis://[[user]:password@]host[:port][/db][?option=value...]      one server
    rediss://...                                                      the same over TLS
    unix://[[user]:password@]/path/to/socket[?db=N]                   one server, a socket
    redis+cluster://[[user]:password@]host:port[,host:port...][?...]  Redis Cluster
    rediss+cluster://...                                              the same over TLS
    redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db][?...]
    rediss+sentinel://...                                             the same over TLS

`host:port` pairs of a cluster are seeds: the client learns the rest of the cluster from
them and follows it as slots move. Those of a sentinel URL are the sentinels, which name the
service's master; the client asks them again whenever its connection to the master drops.
User and password are those of the data nodes; sentinels with a password of their own take
`?sentinel_password=...` (and `sentinel_username`). Every other query option is redis-py's
own (`ssl_cert_reqs=none`, `ssl_ca_certs=/path`, ...). The port defaults to 6379 (26379 for a
sentinel). A cluster has only db 0.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode

import redis.asyncio as aioredis
from redis import __version__ as redis_version
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import SSLConnection, parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelManagedSSLConnection
from redis.backoff import NoBackoff
from redis.driver_info import DriverInfo
from redis.exceptions import ConnectionError, TimeoutError

StoreRedis = aioredis.Redis | RedisCluster


@dataclass(frozen=True)
class StoreURL:
    """A parsed store URL: the topology, its seed addresses and the connection options."""

    topology: str  # "single" | "cluster" | "sentinel"
    tls: bool
    hosts: list[tuple[str, int]]
    service: str  # sentinel only
    options: dict[str, Any]  # redis-py connection kwargs (credentials, db, TLS options)
    sentinel_options: dict[str, Any]


def parse_store_url(url: str) -> StoreURL:
    """Parse and check a store URL; ValueError with the reason when it is not one."""
    scheme, sep, rest = url.partition("://")
    base, _, topology = scheme.lower().partition("+")
    known = base in ("redis", "rediss") or (base == "unix" and not topology)
    if not sep or not known or topology not in ("", "cluster", "sentinel"):
        raise ValueError(
            f"store URL scheme {scheme!r}: use redis://, rediss://, unix://, "
            "redis+cluster://, rediss+cluster://, redis+sentinel:// or rediss+sentinel://"
        )
    if not topology:
        options = dict(parse_url(url))  # redis-py's own grammar, errors and all
        tls = options.get("connection_class") is SSLConnection
        host = (str(options.get("host", "localhost")), int(options.get("port", 6379)))
        return StoreURL("single", tls, [host], "", options, {})
    query = ""
    if "?" in rest:
        rest, query = rest.split("?", 1)
    netloc, _, path = rest.partition("/")
    userinfo, _, hostlist = netloc.rpartition("@")
    default_port = 26379 if topology == "sentinel" else 6379
    hosts = [_host_port(h, default_port) for h in hostlist.split(",") if h]
    if not hosts:
        raise ValueError(f"store URL {redact(url)!r} names no host:port")
    pairs = parse_qsl(query)
    sentinel_options = {
        k.removeprefix("sentinel_"): unquote(v) for k, v in pairs if k.startswith("sentinel_")
    }
    query = urlencode([(k, v) for k, v in pairs if not k.startswith("sentinel_")])
    parts = [p for p in path.split("/") if p]
    service = ""
    if topology == "sentinel":
        if not 1 <= len(parts) <= 2:
            raise ValueError("a sentinel URL ends in /<service>[/<db>]")
        service = unquote(parts[0])
        parts = parts[1:]
    elif parts:
        raise ValueError("a cluster URL has no path: a cluster has only db 0")
    one = f"{base}://{userinfo + '@' if userinfo else ''}localhost/{''.join(parts)}"
    options = dict(parse_url(f"{one}?{query}" if query else one))
    tls = options.pop("connection_class", None) is SSLConnection
    options.pop("host", None)
    options.pop("port", None)
    return StoreURL(topology, tls, hosts, service, options, sentinel_options)


def _host_port(text: str, default_port: int) -> tuple[str, int]:
    if text.startswith("["):  # an IPv6 address: [::1]:7000
        host, _, port = text[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = text.partition(":")
    try:
        return unquote(host), int(port) if port else default_port
    except ValueError:
        raise ValueError(f"bad host:port {text!r} in the store URL") from None


def redact(url: str) -> str:
    """The URL without its password (never logged)."""
    if "@" in url:
        scheme, _, rest = url.partition("://")
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return url


def _common(timeout_s: float) -> dict[str, Any]:
    return {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        # A pooled connection that died with a Redis restart or a failover is retried once
        # on a fresh one; every write script is idempotent (store.py), so a retry can never
        # write a turn twice.
        "retry": Retry(NoBackoff(), 1),
        "retry_on_error": [ConnectionError, TimeoutError],
        "health_check_interval": 30,
        # given once: otherwise every new pooled connection looks the version up in the
        # package metadata (~0.6 ms each, most of a 200-session burst's connection cost)
        "driver_info": DriverInfo(lib_version=redis_version),
    }


def _single(url: str, parsed: StoreURL, timeout_s: float) -> _Clients:
    return aioredis.Redis.from_url(url, max_connections=256, **_common(timeout_s)), []


def _cluster(url: str, parsed: StoreURL, timeout_s: float) -> _Clients:
    client = RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in parsed.hosts],
        ssl=parsed.tls,
        max_connections=256,  # per node
        **parsed.options,
        **_common(timeout_s),
    )
    return client, []


def _sentinel(url: str, parsed: StoreURL, timeout_s: float) -> _Clients:
    sentinel_kwargs = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "ssl": parsed.tls,
        **parsed.sentinel_options,
    }
    sentinel = Sentinel(parsed.hosts, sentinel_kwargs=sentinel_kwargs)
    extra: dict[str, Any] = {"connection_class": SentinelManagedSSLConnection} if parsed.tls else {}
    client = sentinel.master_for(
        parsed.service, max_connections=256, **parsed.options, **_common(timeout_s), **extra
    )
    return client, list(sentinel.sentinels)  # the connections to the Sentinels close too


# (the store's client, and other clients it made that must be closed with it)
_Clients = tuple[StoreRedis, list[aioredis.Redis]]
_TOPOLOGIES: dict[str, Callable[[str, StoreURL, float], _Clients]] = {
    "single": _single,
    "cluster": _cluster,
    "sentinel": _sentinel,
}


@contextlib.asynccontextmanager
async def open_store_redis(url: str, *, timeout_s: float) -> AsyncIterator[StoreRedis]:
    """The client for the URL's topology, closed when the context ends."""
    parsed = parse_store_url(url)
    client, others = _TOPOLOGIES[parsed.topology](url, parsed, timeout_s)
    try:
        yield client
    finally:
        for c in (client, *others):
            await c.aclose()
