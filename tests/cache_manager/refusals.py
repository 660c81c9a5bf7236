"""A redis-server of the test's own that refuses commands the ways a real one does: for the
tests of what the store, the manager and the gateway's rate limits answer then.

    oom           maxmemory reached under `noeviction`: writes refused (OOM)
    misconf       an RDB save failed with stop-writes-on-bgsave-error: writes refused (MISCONF)
    busy          another client's script runs past the busy threshold: all refused (BUSY)
    noperm        the ACL user may not run scripts (NOPERM)
    noperm-write  the ACL user may not write: a script's write is refused
    readonly      a master demoted to a replica (REPLICAOF): writes refused (READONLY)

Only servers a test started are touched (never one on a fixed port).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from ctxcache.net import free_port
from ctxcache.redis_server import RedisServer

KINDS = ("oom", "misconf", "busy", "noperm", "noperm-write", "readonly")
USER, PASSWORD = "ctx", "ctx-password"  # the ACL user `url_of` connects as
RDB = "refuse.rdb"  # the RDB file name a `misconf` server cannot write (a directory there)


def server(root: Path) -> RedisServer:
    """A server `refusing` can work on (start it, then `refusing(it, kind)`)."""
    return RedisServer(root, extra=["--dbfilename", RDB])


def url_of(srv: RedisServer) -> str:
    """The server's URL as the ACL user that `noperm` kinds take rights from."""
    admin = redis.Redis(port=srv.port)
    try:
        admin.execute_command("ACL", "SETUSER", USER, "on", f">{PASSWORD}", "~*", "+@all")
    finally:
        admin.close()
    return f"redis://{USER}:{PASSWORD}@127.0.0.1:{srv.port}/0"


@contextlib.contextmanager
def refusing(srv: RedisServer, kind: str) -> Iterator[None]:
    """While inside: the server refuses as `kind` says (see the module); after: it serves."""
    admin = redis.Redis(port=srv.port)
    try:
        with _REFUSALS[kind](srv, admin):
            yield
    finally:
        admin.close()


@contextlib.contextmanager
def _oom(srv: RedisServer, admin: redis.Redis) -> Iterator[None]:
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", 1)
    try:
        yield
    finally:
        admin.config_set("maxmemory", 0)


@contextlib.contextmanager
def _misconf(srv: RedisServer, admin: redis.Redis) -> Iterator[None]:
    blocker = srv.data_dir / RDB
    blocker.mkdir()  # the save's rename onto it fails: the last save is an error
    admin.config_set("save", "3600 1")  # (stop-writes-on-bgsave-error needs a save point)
    admin.bgsave()
    deadline = time.monotonic() + 10
    while True:
        info = admin.info("persistence")
        if not info["rdb_bgsave_in_progress"] and info["rdb_last_bgsave_status"] == "err":
            break
        assert time.monotonic() < deadline, "the RDB save did not fail"
        time.sleep(0.02)
    try:
        yield
    finally:
        admin.config_set("save", "")  # no save point: writes are taken again
        blocker.rmdir()


@contextlib.contextmanager
def _busy(srv: RedisServer, admin: redis.Redis) -> Iterator[None]:
    admin.config_set("lua-time-limit", 50)
    looping = redis.Redis(port=srv.port)
    ended = threading.Event()

    def loop() -> None:
        with contextlib.suppress(redis.ResponseError):  # killed below
            looping.eval("while true do end", 0)
        ended.set()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while True:  # until the busy threshold has passed
        try:
            admin.ping()
        except redis.ResponseError as exc:
            if str(exc).startswith("BUSY"):
                break
        assert time.monotonic() < deadline, "the script did not make the server busy"
        time.sleep(0.02)
    try:
        yield
    finally:
        while not ended.is_set():
            with contextlib.suppress(redis.ResponseError):
                admin.script_kill()
            ended.wait(0.05)
        thread.join(5)
        looping.close()


@contextlib.contextmanager
def _noperm(srv: RedisServer, admin: redis.Redis) -> Iterator[None]:
    admin.execute_command("ACL", "SETUSER", USER, "-evalsha", "-eval")
    try:
        yield
    finally:
        admin.execute_command("ACL", "SETUSER", USER, "+@all")


@contextlib.contextmanager
def _noperm_write(srv: RedisServer, admin: redis.Redis) -> Iterator[None]:
    admin.execute_command("ACL", "SETUSER", USER, "-@write")
    try:
        yield
    finally:
        admin.execute_command("ACL", "SETUSER", USER, "+@all")


@contextlib.contextmanager
def _readonly(srv: RedisServer, admin: redis.Redis) -> Iterator[None]:
    admin.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # a master nobody runs
    try:
        yield
    finally:
        admin.execute_command("REPLICAOF", "NO", "ONE")


_REFUSALS = {
    "oom": _oom,
    "misconf": _misconf,
    "busy": _busy,
    "noperm": _noperm,
    "noperm-write": _noperm_write,
    "readonly": _readonly,
}


@pytest.fixture(name="srv")
def srv_fixture(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of the test's own (`server`), stopped after it: the one the test refuses."""
    s = server(tmp_path / "redis").start()
    try:
        yield s
    finally:
        s.stop()
