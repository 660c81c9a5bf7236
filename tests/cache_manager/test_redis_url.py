"""The store URL grammar: one server, a Redis Cluster or Sentinel, with or without TLS."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cache_manager.redis_url import parse_store_url, redact
from cache_manager.settings import ManagerSettings


def test_one_server_is_redis_py_own_grammar() -> None:
    u = parse_store_url("redis://:pw@cache.internal:6380/2?health_check_interval=5")
    assert (u.topology, u.tls, u.hosts) == ("single", False, [("cache.internal", 6380)])
    assert u.options["db"] == 2 and u.options["password"] == "pw"
    assert parse_store_url("rediss://cache.internal").tls


def test_cluster_seeds_default_port_ipv6_and_tls() -> None:
    u = parse_store_url("rediss+cluster://user:pw@a:7000,b,[::1]:7002?ssl_cert_reqs=none")
    assert u.topology == "cluster" and u.tls
    assert u.hosts == [("a", 7000), ("b", 6379), ("::1", 7002)]
    assert u.options["username"] == "user" and u.options["password"] == "pw"
    assert u.options["ssl_cert_reqs"] == "none"


def test_sentinel_service_db_and_sentinel_credentials() -> None:
    u = parse_store_url("redis+sentinel://:pw@s1,s2:26380/mymaster/3?sentinel_password=spw")
    assert (u.topology, u.service, u.options["db"]) == ("sentinel", "mymaster", 3)
    assert u.hosts == [("s1", 26379), ("s2", 26380)]
    assert u.options["password"] == "pw" and u.sentinel_options == {"password": "spw"}
    assert "db" not in parse_store_url("redis+sentinel://s1/mymaster").options


@pytest.mark.parametrize(
    "url",
    [
        "http://a:1",
        "redis+cluster://",
        "redis+cluster://a:1/3",  # a cluster has only db 0
        "redis+sentinel://s1:26379",  # no service
        "redis+sentinel://s1:26379/m/0/x",
        "redis+cluster://a:notaport",
        "unix+cluster:///tmp/redis.sock",
        "redis+proxy://a:1",
    ],
)
def test_bad_urls_are_refused_at_start_up(url: str) -> None:
    with pytest.raises(ValueError):
        parse_store_url(url)
    with pytest.raises(ValidationError):
        ManagerSettings(redis_url=url)


def test_replica_wait_must_end_before_the_socket_timeout() -> None:
    with pytest.raises(ValidationError, match="redis_wait_timeout_ms"):
        ManagerSettings(redis_wait_replicas=1, redis_wait_timeout_ms=2000, redis_timeout_s=1)
    ManagerSettings(redis_wait_replicas=1, redis_wait_timeout_ms=500, redis_timeout_s=1)


def test_passwords_are_never_logged() -> None:
    assert redact("redis+cluster://:secret@a:1,b:2") == "redis+cluster://***@a:1,b:2"
