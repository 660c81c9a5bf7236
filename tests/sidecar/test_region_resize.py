"""A restart into a region of another size never serves an earlier writer's bytes (issue 56,
item 1; docs/sidecar.md, "Invariants of the local path": region size changes).

The hostile sequence: a sidecar with a 1 MiB memory tier, an engine that allocs a 256 KiB
write slot, the sidecar stopped with the engine still connected (an operator lowers
`--memory-bytes` while vLLM runs), a new sidecar on the same directory with 64 KiB, a TCP
PUT of a 16 KiB block, then the old writer finishes its copy — into its old mapping of
the same file (`recycle_stale` reuses it, larger than the new region). The new block must
still read as itself, over TCP and through shared memory.

Mechanism: the region's file only grows, so every extent an old writer holds lies in it;
the next sidecar keeps the part of each that lies in its own region out of its allocator,
and keeps the record whole in the write table, so the sidecar after it (of any size) keeps
it out too, until the writer commits, aborts or is gone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.arena import ALIGN, HEADER_BYTES, OLD_MAGICS, Arena, region_name
from sidecar.arena_clients import drop_client_lock, take_client_lock
from sidecar.client import KVClient
from sidecar.local_client import LocalClient, WriteLease
from sidecar.local_protocol import TCP, Slot
from sidecar.protocol import DTYPE_BFLOAT16, FMT_KV_2LTD
from tests.sidecar.helpers import SHAPE, SidecarFactory, SidecarProcess
from tests.utils import local_dir_fixture  # noqa: F401 (the local_dir fixture)

KIB, MIB = 1 << 10, 1 << 20
BLOCK = 16 * KIB


def key(i: int) -> str:
    return f"m@1@0@{i}@bfloat16@s%resize"


def start(factory: SidecarFactory, local_dir: Path, memory: int) -> SidecarProcess:
    return factory("--local-dir", str(local_dir), "--memory-bytes", str(memory))


def put_tcp(proc: SidecarProcess, k: str, data: bytes) -> None:
    with KVClient("127.0.0.1", proc.data_port) as c:
        c.put(k, data, fmt=FMT_KV_2LTD, dtype=DTYPE_BFLOAT16, shape=SHAPE)
        c.health()  # PUT has no reply: a round trip after it means it was taken in


def get_tcp(proc: SidecarProcess, k: str) -> bytes | None:
    with KVClient("127.0.0.1", proc.data_port) as c:
        got = c.get(k)
    return None if got is None else bytes(got.data)


@contextlib.contextmanager
def engine(local_dir: Path) -> Iterator[LocalClient]:
    c = LocalClient(local_dir)
    try:
        yield c
    finally:
        c.close()


def finish_copy(lease: WriteLease) -> None:
    """The old writer finishes its copy: every byte of its slot, through its old mapping."""
    slot = lease.slots[0]
    lease.view(slot)[:] = b"\xee" * slot.length


def read_shm(reader: LocalClient, proc: SidecarProcess, k: str) -> bytes | None:
    """What a shared-memory reader gets for `k`: the slot's bytes, if its release says the
    copy holds; the TCP path's, if the sidecar sends it there (no slot for it)."""
    lease = reader.lease([k])
    got = lease.blocks[0]
    if isinstance(got, Slot):
        data = bytes(lease.view(got))
        assert reader.release(lease), "the copy must hold: nothing wrote the slot"
        return data
    assert got == TCP
    assert reader.release(lease)
    return get_tcp(proc, k)


@pytest.mark.parametrize(
    ("memories", "slot"),
    [
        pytest.param([MIB, 64 * KIB], 256 * KIB, id="shrink"),
        pytest.param([64 * KIB, MIB], BLOCK, id="grow"),
        pytest.param([MIB, 64 * KIB, MIB], 256 * KIB, id="shrink-then-grow"),
        pytest.param([MIB, 256 * KIB, 64 * KIB], 256 * KIB, id="shrink-twice"),
        pytest.param([64 * KIB, MIB, 64 * KIB], BLOCK, id="grow-then-shrink"),
    ],
)
def test_a_writer_of_a_region_of_another_size_never_overwrites_a_later_sidecars_block(
    sidecar_process: SidecarFactory, local_dir: Path, memories: list[int], slot: int
) -> None:
    proc = start(sidecar_process, local_dir, memories[0])
    with engine(local_dir) as writer:
        lease = writer.alloc([slot])  # the engine's write slot, first fit: the region's start
        assert lease is not None and lease.slots[0].offset == HEADER_BYTES
        for n, memory in enumerate(memories[1:], 1):
            proc.stop()  # with the engine connected: the region is left to the next sidecar
            assert len(list(local_dir.glob("kv-*.shm"))) == 1
            proc = start(sidecar_process, local_dir, memory)
            new = bytes([n]) * BLOCK
            put_tcp(proc, key(n), new)  # first fit: inside the old writer's extent, if free
            finish_copy(lease)
            assert get_tcp(proc, key(n)) == new
            with engine(local_dir) as reader:
                assert read_shm(reader, proc, key(n)) == new
        # the writer is done: the sidecar of another generation stores nothing for it
        assert writer.commit(lease, [(key(0), FMT_KV_2LTD, DTYPE_BFLOAT16, SHAPE)]) == 0
        assert get_tcp(proc, key(0)) is None
        # and its extent is the allocator's again: a slot of the whole share can be had
        share = (int(memories[-1] * 1.125) // 2) // ALIGN * ALIGN
        again = writer.alloc([share])
        assert again is not None
        writer.abort(again)


# ---- the write table, in one process --------------------------------------------------------
def test_the_write_table_keeps_a_record_past_a_smaller_region_for_the_sidecars_after_it(
    local_dir: Path,
) -> None:
    """Each `Arena` here is the next sidecar on the directory (a kill -9 before it: nothing
    closed). The record of a 256 KiB extent survives a 64 KiB region, clipped to it there,
    whole again in the 1 MiB one after it, and its pieces go back when its writer is done."""
    first = Arena(local_dir, MIB)
    slot = first.alloc(256 * KIB)
    assert slot is not None and first.claim(7, 0xABC, [slot])
    start_at = first.offset(slot)
    small = Arena(local_dir, 64 * KIB)
    assert small.inherited == {7: (0xABC, [(start_at, small.capacity)])}  # all of it
    assert small.alloc(ALIGN) is None and small.free_bytes() == 0
    large = Arena(local_dir, MIB)
    assert large.inherited == {7: (0xABC, [(start_at, 256 * KIB)])}
    block = large.alloc(BLOCK)
    assert block is not None and large.offset(block) == start_at + 256 * KIB
    assert large.end_inherited(7)
    assert not large.inherited and large.free_bytes() == large.capacity - BLOCK
    after = Arena(local_dir, MIB)  # the writer is done: no record is left to inherit
    assert not after.inherited
    del slot, block


def test_a_record_wholly_past_a_smaller_region_is_kept_and_ends_with_its_writer(
    local_dir: Path,
) -> None:
    first = Arena(local_dir, MIB)
    head = first.alloc(512 * KIB)
    tail = first.alloc(128 * KIB)  # at 512 KiB: past a 64 KiB region's end
    assert head is not None and tail is not None and first.claim(9, 1, [tail])
    small = Arena(local_dir, 64 * KIB)
    assert small.inherited == {9: (1, [])}  # nothing of it in this region, its record kept
    assert small.free_bytes() == small.capacity
    assert Arena(local_dir, MIB).inherited == {9: (1, [(HEADER_BYTES + 512 * KIB, 128 * KIB)])}
    del head, tail


def test_a_sidecar_killed_while_it_takes_the_table_over_leaves_the_table_whole(
    local_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kept records are never cleared and written again: a sidecar that dies between two
    of them (here: at the first) leaves every record for the one after it."""
    first = Arena(local_dir, MIB)
    a, b = first.alloc(64 * KIB), first.alloc(64 * KIB)
    assert first.claim(1, 1, [a]) and first.claim(2, 1, [b])

    def killed(*args: object) -> None:
        raise SystemExit("kill -9")

    with monkeypatch.context() as m:
        m.setattr(Arena, "_reserve", killed)
        with pytest.raises(SystemExit):
            Arena(local_dir, MIB)
    assert set(Arena(local_dir, MIB).inherited) == {1, 2}
    del a, b


@pytest.mark.parametrize("engine_alive", [True, False])
def test_a_region_of_another_format_is_not_reused_while_an_engine_may_write_it(
    local_dir: Path, engine_alive: bool
) -> None:
    """A region an older ctxcache left (no write table: where its writers write is unknown,
    this format's table included) becomes the new region only when no engine client lives;
    otherwise a new file takes its place, and the old one's writers write where nobody
    reads."""
    old = local_dir / region_name("0" * 16)
    old.write_bytes(OLD_MAGICS[0] + b"0" * 16 + bytes(MIB))
    inode = old.stat().st_ino
    token = "ab" * 8
    lock = take_client_lock(local_dir, token) if engine_alive else -1
    try:
        arena = Arena(local_dir, 64 * KIB)
        assert not old.exists() and [p.name for p in local_dir.glob("kv-*.shm")] == [
            arena.path.name
        ]
        assert (arena.path.stat().st_ino == inode) is not engine_alive
        assert not arena.inherited and arena.free_bytes() == arena.capacity
    finally:
        drop_client_lock(local_dir, token, lock)
