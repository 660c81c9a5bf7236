"""The local data path: the shared region, its allocator, leases, and what protects a copy.

Each fault test names the mechanism it checks; without it the test fails (a slot reused
under a lease shows other bytes; a lease that outlived its holder keeps memory taken; a
release after a restart or a timeout would vouch for bytes that are not the block's).
"""

from __future__ import annotations

import gc
import json
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.arena import Arena, RegionError, read_generation
from sidecar.arena_dir import SOCKET_NAME
from sidecar.client import KVClient
from sidecar.local import LocalDirInUse
from sidecar.local_client import TCP, LocalClient, Slot
from sidecar.protocol import DTYPE_BFLOAT16, FMT_KV_2LTD
from sidecar.service import Sidecar
from tests.sidecar.helpers import SHAPE, SidecarFactory, put_tcp
from tests.sidecar.helpers import start_local as start
from tests.utils import local_dir_fixture  # noqa: F401 (the local_dir fixture)

KEY = "m@1@0@{}@bfloat16@s%sess"


def key(i: int) -> str:
    return KEY.format(i)


def payload(n: int, fill: int) -> bytes:
    return bytes([fill]) * n


# ---- the region and its allocator -------------------------------------------------------
def test_the_region_is_a_0660_file_named_and_headed_by_its_generation(local_dir: Path) -> None:
    arena = Arena(local_dir, 1 << 20)
    try:
        assert arena.path.name == f"kv-{arena.generation}.shm"
        assert stat.S_IMODE(arena.path.stat().st_mode) == 0o660
        assert read_generation(arena.path) == arena.generation
        assert arena.path.stat().st_blocks * 512 >= arena.size  # reserved up front
    finally:
        arena.close()
    assert not arena.path.exists()


def test_a_region_the_directory_cannot_hold_is_refused_at_start(local_dir: Path) -> None:
    with pytest.raises(RegionError, match="cannot hold"):
        Arena(local_dir, 1 << 50)
    assert list(local_dir.glob("kv-*")) == []


def test_slots_are_given_back_when_their_last_reference_goes_and_free_space_coalesces(
    local_dir: Path,
) -> None:
    arena = Arena(local_dir, 64 << 10)
    total = arena.largest_free()
    a, b, c = arena.alloc(10_000), arena.alloc(20_000), arena.alloc(4096)
    assert a is not None and b is not None and c is not None
    assert arena.alloc(total) is None  # no room for more than what is free
    view = memoryview(b)[100:200]  # a view keeps its slot
    del b
    gc.collect()
    assert arena.slots == 3
    del view, a
    gc.collect()
    assert arena.slots == 1
    del c
    gc.collect()
    assert arena.used == 0 and arena.largest_free() == total  # one extent again
    arena.close()


# ---- interop with the TCP path ------------------------------------------------------------
def test_a_block_put_over_tcp_is_leased_from_the_region_and_a_local_store_is_read_over_tcp(
    local: Sidecar, local_dir: Path
) -> None:
    put_tcp(local, key(1), payload(1000, 7))
    client = LocalClient(local_dir)
    try:
        lease = client.lease([key(1), key(2)])
        slot = lease.blocks[0]
        assert isinstance(slot, Slot) and lease.blocks[1] is None
        assert (slot.length, slot.fmt, slot.shape) == (1000, FMT_KV_2LTD, SHAPE)
        assert bytes(lease.view(slot)) == payload(1000, 7)
        assert client.release(lease)

        client.put(key(3), payload(3000, 9), fmt=FMT_KV_2LTD, dtype=DTYPE_BFLOAT16, shape=SHAPE)
        with KVClient("127.0.0.1", local.port) as tcp:
            got = tcp.get(key(3))
        assert got is not None and bytes(got.data) == payload(3000, 9)
        assert got.shape == SHAPE
        assert client.exists_many([key(3), key(4)]) == [True, False]
        assert [b is not None for b in client.get_many([key(1), key(4)])] == [True, False]
    finally:
        client.close()


# ---- faults -------------------------------------------------------------------------------
def test_a_block_overwritten_and_evicted_during_a_copy_keeps_its_bytes_under_the_lease(
    local_dir: Path,
) -> None:
    """Mechanism: a lease holds its slot, so neither the store's eviction nor a new PUT of
    the same key can reuse those bytes until it is released."""
    sc = start(local_dir, memory=64 << 10, local_bytes=80 << 10)
    client = LocalClient(local_dir)
    try:
        put_tcp(sc, key(1), payload(32 << 10, 1))
        lease = client.lease([key(1)])
        slot = lease.blocks[0]
        assert isinstance(slot, Slot)
        # the same key again, and enough other blocks to push everything old out
        put_tcp(sc, key(1), payload(32 << 10, 2))
        for i in range(10, 16):
            put_tcp(sc, key(i), payload(32 << 10, 3))
        assert bytes(lease.view(slot)) == payload(32 << 10, 1)  # untouched under the lease
        assert client.release(lease)
        gc.collect()
        assert sc.arena is not None and sc.arena.slots <= 2  # and given back after it
    finally:
        client.close()
        sc.stop()


def test_a_lease_past_its_timeout_is_a_miss(local: Sidecar, local_dir: Path) -> None:
    """Mechanism: leases expire, and a release after that says the copy is not vouched for."""
    put_tcp(local, key(1), payload(1000, 7))
    client = LocalClient(local_dir)
    try:
        lease = client.lease([key(1)])
        assert local.local is not None
        assert local.local.expire(now=float("inf")) == 1
        assert not client.release(lease)
    finally:
        client.close()


ENGINE = """
import sys, time
from sidecar.local_client import LocalClient
c = LocalClient(sys.argv[1])
lease = c.lease([sys.argv[2]])
assert lease.id and c.alloc([200000]) is not None
print("holding", flush=True)
time.sleep(600)
"""


def test_an_engine_killed_holding_leases_gives_every_slot_back(
    local: Sidecar, local_dir: Path
) -> None:
    """Mechanism: a connection's leases end with it (no timeout to wait for): an engine
    process killed with -9 while it holds a lease and an allocated slot."""
    assert local.arena is not None and local.local is not None
    put_tcp(local, key(1), payload(1000, 7))
    gc.collect()
    idle = local.arena.used
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, str(local_dir), key(1)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert engine.stdout is not None and engine.stdout.readline() == "holding\n"
        assert local.local.leases == 2 and local.arena.used >= idle + 200000
        engine.kill()
        engine.wait(timeout=10)
        _wait(lambda: local.local is not None and local.local.leases == 0)
        gc.collect()
        assert local.arena.used == idle  # the allocated slot is free again
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait(timeout=10)
        assert engine.stdout is not None
        engine.stdout.close()


def test_a_restarted_sidecar_is_remapped_and_nothing_stale_is_read(local_dir: Path) -> None:
    """Mechanisms: the generation — a lease from before the restart is not vouched for, and
    the client maps the new region instead of reading the old one's bytes; and the region
    file, kept while engines map it and taken over by the next sidecar (`recycle_stale`).
    An engine keeps its old mapping until it next talks to the sidecar, and those pages
    stay taken whatever happens to the file: a new file beside them needs the room twice,
    which compose's tmpfs volume and a Kubernetes `emptyDir` sized for one region do not
    have (the restarted sidecar then could not start). So the new region is the old file:
    same memory, the new generation in its first page."""
    first = start(local_dir)
    client = LocalClient(local_dir)
    try:
        put_tcp(first, key(1), payload(1000, 7))
        lease = client.lease([key(1)])
        old = client.region
        assert old is not None
        inode = old.path.stat().st_ino
        first.stop()
        assert old.path.exists()  # an engine maps it: left for the next sidecar
        second = start(local_dir)
        try:
            assert second.arena is not None
            assert second.arena.path.stat().st_ino == inode
            assert list(local_dir.glob("kv-*.shm")) == [second.arena.path]
            # the engine's old mapping is the new region: it reads the new generation there
            head = bytes(old.map[8 : 8 + len(second.arena.generation)])
            assert head.decode() == second.arena.generation
            assert not client.release(lease)  # and nothing leased before is vouched for
            assert client.lease([key(1)]).blocks == [None]
            assert client.region is not None
            assert client.region.generation == second.arena.generation
            assert not old.path.exists()  # (renamed)
        finally:
            second.stop()
    finally:
        client.close()


def test_a_region_left_by_a_killed_sidecar_is_reused_and_other_leftovers_removed(
    local_dir: Path,
) -> None:
    """A sidecar killed with -9 never closes its region: the next one takes the largest
    file left (grown to the size it needs) and removes the others; a sidecar that stops
    with no engine connected removes its file."""
    left = []
    for i, size in enumerate((64 << 10, 256 << 10)):  # two sidecars' regions, never closed
        arena = Arena(local_dir / f"elsewhere{i}", size)
        left.append(arena.path.rename(local_dir / arena.path.name))
    largest = left[1].stat().st_ino
    arena = Arena(local_dir, 512 << 10)
    info = arena.path.stat()
    assert info.st_ino == largest and info.st_blocks * 512 >= arena.size
    assert list(local_dir.glob("kv-*.shm")) == [arena.path]
    assert read_generation(arena.path) == arena.generation
    arena.close()
    assert list(local_dir.glob("kv-*.shm")) == []
    start(local_dir).stop()
    assert list(local_dir.glob("kv-*.shm")) == []


def test_a_region_held_by_stores_in_flight_sends_stores_over_tcp_and_counts_it(
    local_dir: Path,
) -> None:
    """Another engine holds most of the region in slots it has not committed: nothing the
    memory tier could evict frees them, so a store goes over TCP (counted) into the heap,
    and a lease of that block says "read it over TCP"."""
    sc = start(local_dir, memory=256 << 10)
    fallback: list[KVClient] = []

    def tcp() -> KVClient:
        fallback.append(KVClient("127.0.0.1", sc.port))
        return fallback[0]

    holders = [LocalClient(local_dir), LocalClient(local_dir)]  # half the region each at most
    client = LocalClient(local_dir, fallback=tcp)
    try:
        assert all(h.alloc([120 << 10]) is not None for h in holders)  # of a 288 KiB region
        assert client.alloc([128 << 10]) is None
        client.put(
            key(1), payload(128 << 10, 5), fmt=FMT_KV_2LTD, dtype=DTYPE_BFLOAT16, shape=SHAPE
        )
        assert fallback  # it went over TCP
        fallback[0].health()
        assert sc.store.exists(key(1))
        assert sc.metrics.region_full._value.get() >= 2
        assert client.lease([key(1)]).blocks == [TCP]
        got = client.get_many([key(1)])[0]
        assert got is not None and bytes(got.data) == payload(128 << 10, 5)
    finally:
        for h in holders:
            h.close()
        client.close()
        sc.stop()


def test_a_second_sidecar_on_the_same_directory_refuses_to_start(
    local: Sidecar, local_dir: Path
) -> None:
    with pytest.raises(LocalDirInUse):
        start(local_dir)
    assert local.arena is not None and local.arena.path.exists()  # the first one's is intact


def test_bad_requests_get_an_error_and_the_socket_keeps_serving(
    local: Sidecar, local_dir: Path
) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(local_dir / SOCKET_NAME))
    reader = sock.makefile("rb")
    try:
        for line in (
            b"not json\n",
            b"[1, 2]\n",
            b'{"op": "nope"}\n',
            b'{"op": "lease", "keys": "abc"}\n',
            b'{"op": "alloc", "lengths": [-1]}\n',
            b'{"op": "release", "lease": "x"}\n',
            b'{"op": "commit", "lease": 999, "blocks": []}\n',
        ):
            sock.sendall(line)
            assert json.loads(reader.readline())["ok"] is False
        sock.sendall(b'{"op": "hello"}\n')
        assert json.loads(reader.readline())["ok"] is True
    finally:
        reader.close()
        sock.close()


def test_the_sidecar_process_killed_during_a_load_is_a_miss_and_its_files_are_reclaimed(
    sidecar_process: SidecarFactory, local_dir: Path
) -> None:
    proc = sidecar_process("--local-dir", str(local_dir), "--memory-bytes", str(1 << 20))
    with KVClient("127.0.0.1", proc.data_port) as c:
        c.put(key(1), payload(1000, 7), fmt=FMT_KV_2LTD, dtype=DTYPE_BFLOAT16, shape=SHAPE)
        c.health()
    client = LocalClient(local_dir)
    try:
        lease = client.lease([key(1)])
        assert isinstance(lease.blocks[0], Slot)
        proc.kill()
        assert not client.release(lease)  # the copy is not used
        restarted = sidecar_process(
            "--local-dir", str(local_dir), "--memory-bytes", str(1 << 20), data_port=proc.data_port
        )
        assert len(list(local_dir.glob("kv-*.shm"))) == 1  # the dead one's region is gone
        assert client.lease([key(1)]).blocks == [None]
        assert restarted
    finally:
        client.close()


_VIEW_OUTLIVES_CLOSE = """
import sys
import torch
from sidecar.local_client import LocalClient, Slot

client = LocalClient(sys.argv[1])
lease = client.lease([sys.argv[2]])
slot = lease.blocks[0]
assert isinstance(slot, Slot)
region = torch.frombuffer(client.region.map, dtype=torch.uint8)  # the connector's view
client.release(lease)
client.close()
sys.stdout.write(bytes(region[slot.offset : slot.offset + 4].tolist()).hex())
"""


def test_a_tensor_over_the_region_outlives_the_clients_close(
    local: Sidecar, local_dir: Path
) -> None:
    """Mechanism: `Region.close` never unmaps. `torch.frombuffer` holds the mmap object but
    no buffer export, so `mmap.close()` would succeed under a live tensor, and the
    tensor's next read would segfault (here: in a child process, so the crash is a
    failure and not pytest's end)."""
    put_tcp(local, key(1), payload(1000, 7))
    out = subprocess.run(
        [sys.executable, "-c", _VIEW_OUTLIVES_CLOSE, str(local_dir), key(1)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == "07" * 4


def _wait(cond: object, timeout: float = 5.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def test_a_full_memory_tier_makes_room_in_the_region_for_a_local_store(local_dir: Path) -> None:
    """The region is the memory tier plus an eighth: when the tier is full, an alloc evicts
    as the PUT would (least recently used first) instead of sending the store to TCP."""
    sc = start(local_dir, memory=256 << 10)
    client = LocalClient(local_dir)
    try:
        for i in range(12):  # three times the memory tier, 64 KiB at a time
            got = client.alloc([64 << 10])
            assert got is not None, f"store {i} found the region full"
            got.view(got.slots[0])[:] = payload(64 << 10, i)
            assert client.commit(got, [(key(i), FMT_KV_2LTD, DTYPE_BFLOAT16, SHAPE)]) == 1
        assert sc.metrics.region_full._value.get() == 0
        assert client.exists_many([key(0), key(11)]) == [False, True]  # the oldest left
        got_back = client.get_many([key(11)])[0]
        assert got_back is not None and bytes(got_back.data) == payload(64 << 10, 11)
    finally:
        client.close()
        sc.stop()
