"""The local path never serves wrong KV, and refuses rather than breaks (issue 46).

Each test names the mechanism it checks (docs/sidecar.md, "Invariants of the local path"):
- store leases: slots given to a writer go to nobody else until that writer is done (its
  commit or abort) or gone (its lock let go), across timeouts, dropped connections and
  sidecar restarts (the region's write table);
- generations: every lease carries the generation it was taken in, captured with the reply;
- the region lives as long as an engine may map it (its client's lock), not only while it
  is connected;
- the protocol refuses, never breaks: out-of-range headers, hostile JSON, an alloc of the
  whole region, a thousand idle connections;
- the directory is checked: a planted symlink or someone else's file is never adopted.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import resource
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sidecar.arena import Arena, RegionError
from sidecar.arena_dir import SOCKET_NAME
from sidecar.client import KVClient
from sidecar.local_client import LocalClient, LocalError, WriteLease
from sidecar.protocol import DTYPE_BFLOAT16, FMT_KV_2LTD
from sidecar.service import Sidecar
from tests.sidecar.helpers import SHAPE, SidecarFactory, put_tcp
from tests.sidecar.helpers import start_local as start
from tests.utils import local_dir_fixture  # noqa: F401 (the local_dir fixture)

BLOCK = 64 << 10


def key(i: int) -> str:
    return f"m@1@0@{i}@bfloat16@s%sess"


def get_tcp(sc: Sidecar, k: str) -> bytes | None:
    with KVClient("127.0.0.1", sc.port) as c:
        got = c.get(k)
    return None if got is None else bytes(got.data)


def get_local(client: LocalClient, k: str) -> bytes | None:
    got = client.get_many([k])[0]
    return None if got is None else bytes(got.data)


@contextlib.contextmanager
def client(local_dir: Path) -> Iterator[LocalClient]:
    c = LocalClient(local_dir)
    try:
        yield c
    finally:
        c.close()


def keep_writing(lease: WriteLease) -> None:
    """What a writer that was not told to stop does: write its slot again."""
    lease.view(lease.slots[0])[:] = b"\xee" * lease.slots[0].length


def region_offset(sc: Sidecar, k: str) -> int | None:
    assert sc.arena is not None
    found = sc.store.get(k)
    assert found is not None
    data = found[1]
    return sc.arena.offset(data) if isinstance(data, np.ndarray) else None


# ---- store leases -----------------------------------------------------------------------
@pytest.mark.parametrize("how", ["timeout", "disconnect"])
def test_a_store_lease_that_ended_keeps_its_slot_from_others_while_its_writer_writes(
    local: Sidecar, local_dir: Path, how: str
) -> None:
    """Mechanism: a write lease that times out or loses its connection only stops its
    commit from storing; its slot is not reused until the writer commits or aborts."""
    assert local.local is not None
    writer, reader = LocalClient(local_dir), LocalClient(local_dir)
    try:
        lease = writer.alloc([BLOCK])
        assert lease is not None
        if how == "timeout":
            local.local.expire(now=time.monotonic() + 3600)
        else:
            writer._disconnect()  # as a timeout on another thread of the engine does
            writer.exists_many([key(0)])  # (and the client reconnects)
        gc.collect()
        put_tcp(local, key(1), b"\x01" * BLOCK)  # first fit: the ended slot, if it were free
        assert region_offset(local, key(1)) != lease.slots[0].offset
        keep_writing(lease)
        assert get_tcp(local, key(1)) == b"\x01" * BLOCK
        assert get_local(reader, key(1)) == b"\x01" * BLOCK
        stored = writer.commit(lease, [(key(2), FMT_KV_2LTD, DTYPE_BFLOAT16, SHAPE)])
        assert stored == (0 if how == "timeout" else 1)
        assert local.local.leases == 0
    finally:
        writer.close()
        reader.close()


def test_a_store_lease_that_outlives_a_restart_keeps_its_slot_from_the_next_sidecar(
    local_dir: Path,
) -> None:
    """Mechanism: the write table in the region. The next sidecar takes the region over and
    keeps the extents an earlier generation's writer still holds, until it says it is done."""
    first = start(local_dir)
    writer = LocalClient(local_dir)
    try:
        lease = writer.alloc([BLOCK])
        assert lease is not None
        first.stop()  # (a kill -9 leaves the same table: it lives in the mapping)
        second = start(local_dir)
        try:
            assert second.arena is not None and lease.id in second.arena.inherited
            put_tcp(second, key(1), b"\x02" * BLOCK)
            assert region_offset(second, key(1)) != lease.slots[0].offset
            keep_writing(lease)  # into the old mapping: the same file
            assert get_tcp(second, key(1)) == b"\x02" * BLOCK
            with client(local_dir) as reader:
                assert get_local(reader, key(1)) == b"\x02" * BLOCK
            # the writer is done: told to the new sidecar, it stores nothing, frees the slot
            assert writer.commit(lease, [(key(2), FMT_KV_2LTD, DTYPE_BFLOAT16, SHAPE)]) == 0
            assert not second.arena.inherited and not second.store.exists(key(2))
        finally:
            second.stop()
    finally:
        writer.close()


def test_an_engine_that_dies_holding_a_store_lease_gives_its_slot_back_at_once(
    local: Sidecar, local_dir: Path
) -> None:
    """Mechanism: the client's lock file. A dead process cannot write: its lock is let go,
    and what it held is free at its disconnect, without waiting for any timeout."""
    assert local.local is not None and local.arena is not None
    gc.collect()
    idle = local.arena.used
    writer = LocalClient(local_dir)
    assert writer.alloc([BLOCK]) is not None
    lock = local_dir / f"client-{writer.token}.lock"
    assert lock.exists()
    os.close(writer._lock_fd)  # what the kernel does when the process dies
    writer._lock_fd = -1
    writer._disconnect()
    _wait(lambda: local.local is not None and local.local.leases == 0)
    gc.collect()
    assert local.arena.used == idle and not lock.exists()
    writer.close()


# ---- generations ------------------------------------------------------------------------
def test_a_lease_taken_while_another_thread_reconnects_to_a_restarted_sidecar_is_a_miss(
    local_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mechanism: the generation is captured with the reply, under the lock that made the
    round trip, and travels with the release. Injected interleaving: right after the lease
    reply, another thread reconnects to a restarted sidecar that stored other bytes where
    the block was; the copy then reads them, and only the release can say so."""
    sidecars = [start(local_dir)]
    engine = LocalClient(local_dir)
    try:
        put_tcp(sidecars[0], key(1), b"\x01" * BLOCK)
        real = engine._call_in

        def lease_then_restart(req: dict[str, Any], **kw: Any) -> Any:
            out = real(req, **kw)
            if req["op"] == "lease":  # the other thread's reconnect wins the race here
                sidecars[0].stop()
                sidecars.append(start(local_dir))
                put_tcp(sidecars[1], key(1), b"\x02" * BLOCK)  # same slot, other bytes
                engine._disconnect()
                engine.connect()
            return out

        monkeypatch.setattr(engine, "_call_in", lease_then_restart)
        assert engine.get_many([key(1)]) == [None]  # a miss, not the new sidecar's bytes
        monkeypatch.undo()
        assert get_local(engine, key(1)) == b"\x02" * BLOCK
    finally:
        engine.close()
        sidecars[-1].stop()


def test_a_release_of_another_generation_or_client_is_refused_and_steals_nothing(
    local: Sidecar, local_dir: Path
) -> None:
    """Mechanism: lease ids are random 64-bit numbers, and a release names its generation
    and comes from the lease's own client."""
    put_tcp(local, key(1), b"\x01" * BLOCK)
    with client(local_dir) as a, client(local_dir) as b:
        la, lb = a.lease([key(1)]), b.lease([key(1)])
        assert la.id != lb.id and min(la.id, lb.id) > 1 << 20
        with raw(local_dir, hello=True) as ask:
            assert ask({"op": "release", "lease": la.id})["ok"] is False  # another client
        with raw(local_dir, hello=False) as ask:
            assert ask({"op": "release", "lease": la.id})["ok"] is False  # an anonymous one
        stale = {"op": "release", "lease": lb.id, "generation": "0" * 16}
        assert b._call(stale, check=False)["ok"] is False
        assert a.release(la) and b.release(lb)  # both still held by their owners


# ---- region lifetime ----------------------------------------------------------------------
def test_an_idle_engine_across_two_restarts_keeps_one_region_file(local_dir: Path) -> None:
    """Mechanism: the region is kept while any engine may map it (its client's lock held),
    not only while one is connected. An engine that has not called since the first restart
    is not connected at the second; removing the file then would leave its pages mapped and
    the third sidecar would need the room twice (a volume sized for one region refuses)."""
    first = start(local_dir)
    engine = LocalClient(local_dir)
    try:
        engine.connect()
        assert first.arena is not None
        inode = first.arena.path.stat().st_ino
        first.stop()
        second = start(local_dir)  # the engine does not call: it stays on its old mapping
        assert second.arena is not None and second.arena.path.stat().st_ino == inode
        assert second.local is not None
        second.stop()  # no engine connected, but one alive
        regions = list(local_dir.glob("kv-*.shm"))
        assert len(regions) == 1 and regions[0].stat().st_ino == inode
        third = start(local_dir)
        assert third.arena is not None and third.arena.path.stat().st_ino == inode
        third.stop()
    finally:
        engine.close()
    start(local_dir).stop()  # no engine alive: the region goes with its sidecar
    assert list(local_dir.glob("kv-*.shm")) == []


# ---- a protocol that refuses, never breaks ----------------------------------------------
@contextlib.contextmanager
def raw(local_dir: Path, *, hello: bool) -> Iterator[Callable[[Any], dict[str, Any]]]:
    """Requests as an engine could send them, one line each; `hello` names a client."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(local_dir / SOCKET_NAME))
    reader = sock.makefile("rb")

    def ask(req: Any) -> dict[str, Any]:
        line = req if isinstance(req, bytes) else json.dumps(req).encode()
        sock.sendall(line + b"\n")
        return json.loads(reader.readline())

    try:
        if hello:
            assert ask({"op": "hello", "client": os.urandom(8).hex(), "lock": False})["ok"]
        yield ask
    finally:
        reader.close()
        sock.close()


@pytest.mark.parametrize(
    "bad",
    [
        {"fmt": 2**31},
        {"fmt": -1},
        {"dtype": 2**40},
        {"shape": [1, 2, 3, 2**31]},
        {"shape": [1, 2, 3]},
        {"shape": [1, 2, 3, "4"]},
        {"key": "k" * 151},
        {"fmt": True},
    ],
)
def test_a_commit_with_an_out_of_range_header_is_refused_and_harms_nothing(
    local: Sidecar, local_dir: Path, bad: dict[str, Any]
) -> None:
    """Mechanism: every field is checked at commit against what lm:// and the disk header
    hold (int32); before, `fmt=2**31` made every TCP GET of the key close its connection
    and broke the spill of its eviction."""
    put_tcp(local, key(9), b"\x09" * 4096)
    with raw(local_dir, hello=True) as ask:
        got = ask({"op": "alloc", "lengths": [4096]})
        assert got["ok"]
        block = {"key": key(1), "fmt": FMT_KV_2LTD, "dtype": DTYPE_BFLOAT16, "shape": list(SHAPE)}
        reply = ask({"op": "commit", "lease": got["lease"], "blocks": [{**block, **bad}]})
        assert reply["ok"] is False and not local.store.exists(key(1))
        # the connection, the lease and the sidecar all serve on
        assert ask({"op": "commit", "lease": got["lease"], "blocks": [block]})["stored"] == 1
    assert get_tcp(local, key(9)) == b"\x09" * 4096
    assert get_tcp(local, key(1)) is not None


def test_infinity_and_deeply_nested_json_get_an_error_and_the_leases_survive(
    local: Sidecar, local_dir: Path
) -> None:
    """Mechanism: each request is answered whatever it is; before, these closed the
    connection with a traceback, and its leases went with it."""
    with raw(local_dir, hello=True) as ask:
        got = ask({"op": "alloc", "lengths": [4096]})
        assert got["ok"]
        for line in (
            b'{"op": "exists", "keys": [Infinity]}',
            b'{"op": "alloc", "lengths": [NaN]}',
            b'{"op": "commit", "lease": 1e999, "blocks": []}',
            b"[" * 200_000 + b"]" * 200_000,
            b'{"op": "exists", "keys": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        ):
            assert ask(line)["ok"] is False
        block = {"key": key(1), "fmt": FMT_KV_2LTD, "dtype": DTYPE_BFLOAT16, "shape": list(SHAPE)}
        assert ask({"op": "commit", "lease": got["lease"], "blocks": [block]})["stored"] == 1


def test_an_alloc_of_the_whole_region_is_refused_without_emptying_the_memory_tier(
    local: Sidecar, local_dir: Path
) -> None:
    """Mechanism: an alloc over one engine's share, or larger than the region could free,
    is refused before anything is evicted."""
    assert local.arena is not None
    for i in range(8):
        put_tcp(local, key(i), bytes([i]) * BLOCK)
    with client(local_dir) as engine:
        assert engine.alloc([local.arena.capacity]) is None
        assert engine.alloc([local.arena.capacity // 2 + 4096]) is None
    assert all(local.store.exists(key(i)) for i in range(8))
    assert get_tcp(local, key(0)) == bytes([0]) * BLOCK


def test_a_thousand_idle_connections_leave_room_for_a_new_engine(
    sidecar_process: SidecarFactory, local_dir: Path
) -> None:
    """Mechanism: a cap on connections that closes the longest idle one for a new one (a
    connection holds no lease: those are its client's), and an accept loop that survives
    anything one connection does."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    proc = sidecar_process("--local-dir", str(local_dir), "--memory-bytes", str(4 << 20))
    idle: list[socket.socket] = []
    try:
        for _ in range(1000):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(local_dir / SOCKET_NAME))
            idle.append(s)
        with KVClient("127.0.0.1", proc.data_port) as c:
            c.put(key(1), b"\x01" * 4096, fmt=FMT_KV_2LTD, dtype=DTYPE_BFLOAT16, shape=SHAPE)
            c.health()
        with client(local_dir) as engine:
            t0 = time.monotonic()
            assert get_local(engine, key(1)) == b"\x01" * 4096
            assert time.monotonic() - t0 < 10
    finally:
        for s in idle:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ---- the directory ------------------------------------------------------------------------
def test_a_symlink_named_like_a_region_is_not_adopted(local_dir: Path, tmp_path: Path) -> None:
    """Mechanism: `O_NOFOLLOW` and a regular-file check; before, the symlink's target was
    made 0660 and its start overwritten."""
    target = tmp_path / "secret"
    target.write_bytes(b"keep me" * 1000)
    target.chmod(0o600)
    (local_dir / "kv-0123456789abcdef.shm").symlink_to(target)
    sc = start(local_dir)
    try:
        assert sc.arena is not None and not sc.arena.path.is_symlink()
        assert target.read_bytes() == b"keep me" * 1000
        assert oct(target.stat().st_mode & 0o777) == oct(0o600)
    finally:
        sc.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="making another user's file needs root")
def test_another_users_region_file_is_not_adopted(local_dir: Path) -> None:
    foreign = local_dir / "kv-fedcba9876543210.shm"
    foreign.write_bytes(b"CTXKV002" + b"x" * 5000)
    os.chown(foreign, 12345, 12345)
    sc = start(local_dir)
    try:
        assert sc.arena is not None and sc.arena.path != foreign
        assert foreign.read_bytes() == b"CTXKV002" + b"x" * 5000
    finally:
        sc.stop()


def test_a_directory_others_can_write_is_refused_unless_sticky(tmp_path: Path) -> None:
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(RegionError, match="writable by every user"):
        Arena(open_dir, 1 << 20)
    open_dir.chmod(0o1777)  # sticky and ours, like /dev/shm is root's: allowed
    Arena(open_dir, 1 << 20).close()


# ---- stores that were not stored --------------------------------------------------------
def test_a_local_put_whose_commit_stored_nothing_goes_over_tcp(
    local: Sidecar, local_dir: Path
) -> None:
    assert local.local is not None
    sent: list[KVClient] = []

    def tcp() -> KVClient:
        sent.append(KVClient("127.0.0.1", local.port))
        return sent[-1]

    engine = LocalClient(local_dir, fallback=tcp)
    try:
        local.local.lease_timeout_s = -1.0  # every lease has ended by its commit
        engine.put(key(1), b"\x05" * 4096, fmt=FMT_KV_2LTD, dtype=DTYPE_BFLOAT16, shape=SHAPE)
        assert sent  # not counted as stored: sent over lm:// instead
        sent[0].health()
        assert get_tcp(local, key(1)) == b"\x05" * 4096
    finally:
        engine.close()
        for c in sent:
            c.close()


def _wait(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_commit_that_found_no_sidecar_is_settled_with_the_next_one(local_dir: Path) -> None:
    """The writer finished while no sidecar answered: the next sidecar keeps the slots (its
    write table) until the writer's next alloc tells it that it is done with them."""
    first = start(local_dir)
    writer = LocalClient(local_dir, timeout=1.0)
    try:
        lease = writer.alloc([BLOCK])
        assert lease is not None
        first.stop()
        with pytest.raises(LocalError):
            writer.commit(lease, [(key(1), FMT_KV_2LTD, DTYPE_BFLOAT16, SHAPE)])
        second = start(local_dir)
        try:
            assert second.arena is not None and lease.id in second.arena.inherited
            assert writer.alloc([4096]) is not None
            assert not second.arena.inherited
        finally:
            second.stop()
    finally:
        writer.close()
