"""The shared-memory load's control plane off the critical path (issue 47).

- Releases ride on the next request (its `release` list) and free their slots there; a
  release nothing else carries is flushed after a short while, and at close.
- A load whose lease is still valid beyond doubt is trusted without a release round trip
  (`sidecar.local_deferred.still_valid`), and is NOT trusted — the release waits for its
  answer, which says the lease ended — when the sidecar was killed or restarted between
  the lease and the end of the copy, when the lease timed out (or came close), or when the
  connection it came on was dropped (docs/sidecar.md, "Invariants of the local path", 8).
"""

from __future__ import annotations

import contextlib
import gc
import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sidecar.arena_dir import SOCKET_NAME
from sidecar.client import KVClient
from sidecar.local_client import LocalClient, Slot
from sidecar.protocol import DTYPE_BFLOAT16, FMT_KV_2LTD
from sidecar.service import Sidecar
from tests.sidecar.helpers import SHAPE, SidecarFactory, put_tcp
from tests.sidecar.helpers import start_local as start
from tests.utils import local_dir_fixture  # noqa: F401 (the local_dir fixture)

BLOCK = 64 << 10


def key(i: int) -> str:
    return f"m@1@0@{i}@bfloat16@s%sess"


def requests(sc: Sidecar, op: str) -> int:
    """Round trips of `op` the sidecar answered on its local socket."""
    got = sc.metrics.registry.get_sample_value("ctxcache_sidecar_local_requests_total", {"op": op})
    return int(got or 0)


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@contextlib.contextmanager
def deferring(local_dir: Path, flush_after_s: float = 60.0) -> Iterator[LocalClient]:
    """A client as the vLLM connector makes it; by default nothing is flushed on its own."""
    c = LocalClient(local_dir, defer_releases=True, flush_after_s=flush_after_s)
    try:
        yield c
    finally:
        c.close()


def copy(c: LocalClient, k: str) -> tuple[object, bytes]:
    """Lease `k` and copy its bytes out, as a load does; the lease and the bytes."""
    lease = c.lease([k])
    slot = lease.blocks[0]
    assert isinstance(slot, Slot)
    return lease, bytes(lease.view(slot))


# ---- releases batched into the next request ---------------------------------------------
def test_a_valid_lease_is_trusted_without_a_round_trip_and_freed_by_the_next_request(
    local: Sidecar, local_dir: Path
) -> None:
    assert local.local is not None
    put_tcp(local, key(1), b"\x01" * BLOCK)
    with deferring(local_dir) as c:
        lease, data = copy(c, key(1))
        assert data == b"\x01" * BLOCK
        releases = requests(local, "release")
        assert c.release(lease)  # type: ignore[arg-type]
        assert requests(local, "release") == releases  # no round trip
        assert c.trusted_releases == 1
        assert local.local.leases == 1  # the sidecar still holds it: not yet told
        assert c.exists_many([key(1)]) == [True]  # the next request carries the release
        assert local.local.leases == 0 and local.local.released_batched == 1
        assert requests(local, "release") == releases


def test_a_release_carried_by_the_next_request_frees_its_slot(
    local: Sidecar, local_dir: Path
) -> None:
    """The slot a piggybacked release lets go is free again: a new block of the same size
    lands in it (first fit), which it could not while the lease held it."""
    assert local.arena is not None and local.local is not None
    put_tcp(local, key(1), b"\x01" * BLOCK)
    first = offset_of(local, key(1))
    with deferring(local_dir) as c:
        lease, _ = copy(c, key(1))
        put_tcp(local, key(1), b"\x02" * BLOCK)  # overwritten: the old slot is the lease's
        gc.collect()
        assert offset_of(local, key(1)) != first
        assert c.release(lease)  # type: ignore[arg-type]
        put_tcp(local, key(2), b"\x03" * BLOCK)
        assert offset_of(local, key(2)) != first  # still held: the release is queued
        assert c.exists_many([key(2)]) == [True]  # the next request carries the release
        assert local.local.released_batched == 1
        gc.collect()
        put_tcp(local, key(3), b"\x04" * BLOCK)
        assert offset_of(local, key(3)) == first  # the slot is free again


def offset_of(sc: Sidecar, k: str) -> int:
    assert sc.arena is not None
    found = sc.store.get(k)
    assert found is not None
    return sc.arena.offset(found[1])


def test_a_queued_release_is_flushed_when_nothing_else_goes_out(
    local: Sidecar, local_dir: Path
) -> None:
    assert local.local is not None
    put_tcp(local, key(1), b"\x01" * BLOCK)
    with deferring(local_dir, flush_after_s=0.5) as c:
        lease, _ = copy(c, key(1))
        assert c.release(lease)  # type: ignore[arg-type]
        assert local.local.leases == 1
        wait_for(lambda: local.local is not None and local.local.leases == 0)
        assert requests(local, "release") == 1  # one round trip, on the flusher's thread


def test_queued_releases_are_flushed_at_close_in_one_round_trip(
    local: Sidecar, local_dir: Path
) -> None:
    assert local.local is not None
    for i in range(3):
        put_tcp(local, key(i), bytes([i]) * BLOCK)
    c = LocalClient(local_dir, defer_releases=True, flush_after_s=60.0)
    try:
        leases = [copy(c, key(i))[0] for i in range(3)]
        assert all(c.release(lease) for lease in leases)  # type: ignore[arg-type]
        assert local.local.leases == 3
    finally:
        c.close()
    assert local.local.leases == 0
    assert requests(local, "release") == 1 and local.local.released_batched == 2


def test_the_release_list_is_released_first_and_a_malformed_one_refuses_the_request(
    local: Sidecar, local_dir: Path
) -> None:
    """The protocol: any request may carry `release`; hello says so; a list that is not
    well formed is refused whole (nothing released), and the connection serves on."""
    assert local.local is not None
    put_tcp(local, key(1), b"\x01" * BLOCK)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(local_dir / SOCKET_NAME))
    reader = sock.makefile("rb")

    def ask(req: object) -> dict[str, object]:
        sock.sendall(json.dumps(req).encode() + b"\n")
        return json.loads(reader.readline())

    try:
        hello = ask({"op": "hello", "client": "00000000000000aa", "lock": False})
        assert hello["release_batch"] is True
        gen = hello["generation"]
        lease = ask({"op": "lease", "keys": [key(1)]})["lease"]
        assert local.local.leases == 1
        for bad in (
            [{"lease": "x"}],
            {"lease": lease},
            [lease],
            [{"lease": lease, "generation": 1}],
        ):
            reply = ask({"op": "exists", "keys": [key(1)], "release": bad})
            assert reply["ok"] is False and "bad request" in str(reply["error"])
            assert local.local.leases == 1
        stale = ask({"op": "exists", "keys": [], "release": [{"lease": lease, "generation": "x"}]})
        assert stale == {"ok": True, "found": [], "released": 0}  # another generation's
        assert local.local.leases == 1
        reply = ask(
            {"op": "exists", "keys": [key(1)], "release": [{"lease": lease, "generation": gen}]}
        )
        assert reply == {"ok": True, "found": [True], "released": 1}
        assert local.local.leases == 0
        assert ask({"op": "release", "lease": lease, "generation": gen}) == {"ok": False}
    finally:
        reader.close()
        sock.close()


def test_an_old_sidecar_that_does_not_take_release_lists_gets_its_own_releases(
    local: Sidecar, local_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sidecar whose hello does not say `release_batch` is never sent a list: each
    queued release goes as its own `release`."""
    assert local.local is not None
    hello = local.local._hello

    def old_hello(*args: object) -> dict[str, object]:
        reply = hello(*args)  # type: ignore[arg-type]
        reply.pop("release_batch")
        return reply

    monkeypatch.setattr(local.local, "_hello", old_hello)
    for i in range(2):
        put_tcp(local, key(i), bytes([i]) * BLOCK)
    with deferring(local_dir) as c:
        leases = [copy(c, key(i))[0] for i in range(2)]
        assert all(c.release(lease) for lease in leases)  # type: ignore[arg-type]
        c.exists_many([key(0)])
        assert local.local.leases == 2  # nothing rode along
        c.flush()
        assert local.local.leases == 0
        assert requests(local, "release") == 2 and local.local.released_batched == 0


# ---- a load trusted only while its lease holds beyond doubt ---------------------------------
def test_a_lease_past_half_its_timeout_waits_for_its_release(local_dir: Path) -> None:
    """Mechanism: the age check. Measured from before the lease was asked for; past half
    the sidecar's `lease_timeout_s` the release is a round trip (here it still held)."""
    sc = start(local_dir, lease_timeout_s=1.0)
    try:
        put_tcp(sc, key(1), b"\x01" * BLOCK)
        with deferring(local_dir) as c:
            lease, _ = copy(c, key(1))
            time.sleep(0.55)
            assert c.release(lease)  # type: ignore[arg-type]
            assert c.trusted_releases == 0 and requests(sc, "release") == 1
    finally:
        sc.stop()


def test_a_lease_that_timed_out_is_not_trusted(local_dir: Path) -> None:
    """A tiny `lease_timeout_s`: the copy ended after the lease did, and the release (a
    round trip) says so."""
    sc = start(local_dir, lease_timeout_s=0.05)
    try:
        put_tcp(sc, key(1), b"\x01" * BLOCK)
        with deferring(local_dir) as c:
            lease, _ = copy(c, key(1))
            time.sleep(0.1)
            assert not c.release(lease)  # type: ignore[arg-type]
            assert c.trusted_releases == 0
    finally:
        sc.stop()


def test_a_lease_the_sidecar_timed_out_closes_its_connection_so_the_client_sees_it(
    local: Sidecar, local_dir: Path
) -> None:
    """Mechanism: the sidecar closes the connection a read lease came on before its slots
    can go, so an expiry the client's clock cannot see (here forced) still fails the
    trust check: the release waits for its answer, which says no."""
    assert local.local is not None
    put_tcp(local, key(1), b"\x01" * BLOCK)
    with deferring(local_dir) as c:
        lease, _ = copy(c, key(1))
        # past the lease's timeout, well before the connection's idle timeout
        local.local.expire(now=time.monotonic() + local.local.lease_timeout_s + 1)
        assert not c.release(lease)  # type: ignore[arg-type]
        assert c.trusted_releases == 0


def test_a_lease_whose_connection_was_dropped_waits_for_its_release(
    local: Sidecar, local_dir: Path
) -> None:
    """The connection the lease came on is not the open one (a timeout on another thread
    reconnected): not trusted; the release goes on the new connection and holds (leases
    are the client's)."""
    assert local.local is not None
    put_tcp(local, key(1), b"\x01" * BLOCK)
    with deferring(local_dir) as c:
        lease, _ = copy(c, key(1))
        c._disconnect()
        c.exists_many([key(1)])  # another thread's call reconnects
        assert c.release(lease)  # type: ignore[arg-type]
        assert c.trusted_releases == 0 and requests(local, "release") == 1
        assert local.local.leases == 0


def test_a_sidecar_evicting_the_connection_makes_the_release_wait(
    local: Sidecar, local_dir: Path
) -> None:
    """The sidecar closed the connection (idle or over its cap), nothing reconnected yet:
    the hang-up shows in the poll."""
    assert local.local is not None
    put_tcp(local, key(1), b"\x01" * BLOCK)
    with deferring(local_dir) as c:
        lease, _ = copy(c, key(1))
        local.local.idle_timeout_s = 0.0
        local.local.expire()
        time.sleep(0.05)
        assert c.release(lease)  # type: ignore[arg-type]
        assert c.trusted_releases == 0


def test_a_restarted_sidecar_between_lease_and_release_is_not_trusted(local_dir: Path) -> None:
    first = start(local_dir)
    try:
        put_tcp(first, key(1), b"\x01" * BLOCK)
        with deferring(local_dir) as c:
            lease, _ = copy(c, key(1))
            first.stop()
            second = start(local_dir)
            try:
                assert not c.release(lease)  # type: ignore[arg-type]
                assert c.trusted_releases == 0
                assert second.local is not None and second.local.leases == 0
            finally:
                second.stop()
    finally:
        first.stop()


def test_a_sidecar_killed_between_lease_and_release_is_not_trusted(
    sidecar_process: SidecarFactory, local_dir: Path
) -> None:
    proc = sidecar_process("--local-dir", str(local_dir), "--memory-bytes", str(1 << 20))
    with KVClient("127.0.0.1", proc.data_port) as kv:
        kv.put(key(1), b"\x01" * BLOCK, fmt=FMT_KV_2LTD, dtype=DTYPE_BFLOAT16, shape=SHAPE)
        kv.health()
    with deferring(local_dir) as c:
        lease, _ = copy(c, key(1))
        proc.kill()
        assert not c.release(lease)  # type: ignore[arg-type]
        assert c.trusted_releases == 0
