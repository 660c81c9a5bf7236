"""The lease's fast path: the answer in columns, the offsets read from a slot's owner, the
store's blocks leased under one lock. Each gives what the slow form gave, or it would
send an engine to other bytes than the block's. And the deferred releases' flusher, woken
at the oldest release's due time, not by each release."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from sidecar import local_protocol
from sidecar.arena import Arena
from sidecar.arena_dir import SOCKET_NAME
from sidecar.blocks import BlockMeta
from sidecar.local_client import TCP, LocalClient, Slot
from sidecar.local_protocol import lease_answer, lease_blocks
from sidecar.store import BlockStore
from tests.sidecar.helpers import SHAPE, put_tcp
from tests.sidecar.helpers import start_local as start
from tests.utils import local_dir_fixture  # noqa: F401 (the local_dir fixture)


def key(i: int) -> str:
    return f"m@1@0@{i}@bfloat16@s%sess"


def test_both_answer_forms_give_the_same_blocks() -> None:
    """Mechanism: the columns give each key its own offset, length and header (two
    headers here, so an index into the wrong one would show)."""
    a = BlockMeta(key(0), 4096, 1001, 3, (32, 16, 1024, 2))
    b = BlockMeta(key(1), 100, 1, 2, (2, 1, 4, 8))
    placed = [(a, 8192), None, (b, 65536), False, (a, 4096)]
    columns = lease_answer(placed, columns=True)  # type: ignore[arg-type]
    assert len(columns["headers"]) == 2
    want = [
        Slot(8192, 4096, 1001, 3, (32, 16, 1024, 2)),
        None,
        Slot(65536, 100, 1, 2, (2, 1, 4, 8)),
        TCP,
        Slot(4096, 4096, 1001, 3, (32, 16, 1024, 2)),
    ]
    assert lease_blocks(columns) == want
    assert lease_blocks(lease_answer(placed, columns=False)) == want  # type: ignore[arg-type]
    assert lease_blocks(json.loads(json.dumps(columns))) == want


def test_without_orjson_the_standard_library_reads_and_refuses_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A machine without orjson (the GPU check's) speaks the same lines: what one encodes
    the other decodes alike, and NaN, Infinity and a top level that is not an object are
    refused by both."""
    message = {"op": "lease", "keys": ["m@1@0@1@bfloat16", "é"], "columns": True, "n": 2**62}
    fast = local_protocol.encode(message)
    monkeypatch.setattr(local_protocol, "orjson", None)
    slow = local_protocol.encode(message)
    assert slow.endswith(b"\n") and slow.count(b"\n") == 1
    for line in (fast, slow):
        assert local_protocol.decode(line) == message
    for bad in (b'{"keys": [NaN]}', b'{"n": Infinity}', b"[1]", b"[" * 5000 + b"]" * 5000):
        with pytest.raises((ValueError, RecursionError)):
            local_protocol.decode(bad)
    monkeypatch.undo()
    assert local_protocol.decode(slow) == message
    for bad in (b'{"keys": [NaN]}', b'{"n": Infinity}', b"[1]", b"[" * 5000 + b"]" * 5000):
        with pytest.raises(ValueError):
            local_protocol.decode(bad)


def test_a_lease_without_columns_is_answered_as_before(local_dir: Path) -> None:
    """An engine of before the columns (it does not ask) gets `blocks`, each a dict."""
    sc = start(local_dir)
    try:
        put_tcp(sc, key(1), b"\x01" * 5000)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(str(local_dir / SOCKET_NAME))
        reader = sock.makefile("rb")
        sock.sendall(json.dumps({"op": "lease", "keys": [key(1), key(2)]}).encode() + b"\n")
        reply = json.loads(reader.readline())
        reader.close()
        sock.close()
        assert reply["ok"] and "offsets" not in reply
        block, miss = reply["blocks"]
        assert miss is None and block["length"] == 5000 and block["shape"] == list(SHAPE)
        engine = LocalClient(local_dir)
        try:
            lease = engine.lease([key(1), key(2)])  # (asks for columns)
            slot = Slot(block["offset"], 5000, block["fmt"], block["dtype"], SHAPE)
            assert lease.blocks == [slot, None]
            assert bytes(lease.view(slot)) == b"\x01" * 5000
            assert engine.release(lease)
        finally:
            engine.close()
    finally:
        sc.stop()


def test_the_offset_of_a_slot_or_any_view_of_it_is_where_its_bytes_are(local_dir: Path) -> None:
    """Mechanism: a whole slot's offset is its owner's; any other view of it is measured
    from its address (a reversed view starts at the slot's end, a slice inside it)."""
    arena = Arena(local_dir, 1 << 20)
    try:
        arena.alloc(10_000)  # (so the next slot does not start at the first one)
        slot = arena.alloc(8192)
        assert slot is not None
        base = int(np.frombuffer(arena._map, dtype=np.uint8).ctypes.data)
        views = [slot, slot[:], slot[100:200], slot[::-1], slot.view(np.uint16)]
        views += [slot.reshape(2, -1), slot[: 8192 // 2], slot[1:]]
        for view in views:
            assert arena.offset(view) == int(view.ctypes.data) - base, view.shape
        assert arena.place(slot) == arena.offset(slot) and arena.place(b"x") is None
        assert arena.place(np.zeros(8192, dtype=np.uint8)) is None  # not in the region
    finally:
        arena.close()


def test_leasing_many_keys_gives_what_leasing_each_gives(local_dir: Path) -> None:
    """Mechanism: blocks in a slot are found under one lock; a block in the heap still
    gets a slot of its own (copied), a missing key is None; hits and misses counted."""
    arena = Arena(local_dir, 1 << 20)
    store = BlockStore(memory_bytes=512 << 10, arena=arena)
    try:
        in_region = arena.alloc(4096)
        assert in_region is not None
        in_region[:] = 7
        assert store.put(BlockMeta(key(1), 4096, 1, 3, SHAPE), in_region)
        heap = bytearray(os.urandom(3000))
        assert store.put(BlockMeta(key(2), 3000, 1, 3, SHAPE), heap)
        before = store.metrics.misses._value.get()
        got = store.lease_many([key(1), key(9), key(2)])
        assert store.metrics.misses._value.get() == before + 1
        (meta1, slot1, at1), miss, (meta2, slot2, at2) = got  # type: ignore[misc]
        assert miss is None and meta1.key == key(1) and meta2.key == key(2)
        assert at1 == arena.offset(in_region) and slot1 is in_region
        assert at2 == arena.offset(slot2) and bytes(slot2) == bytes(heap)  # copied in
        assert store.lease_many([key(2)])[0][1] is slot2  # type: ignore[index]
    finally:
        del in_region, got, slot1, slot2
        arena.close()


class CountingCondition(threading.Condition):
    def __init__(self, lock: threading.RLock) -> None:
        super().__init__(lock)
        self.waits = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        return super().wait(timeout)


def test_loads_that_carry_their_releases_seldom_wake_the_flusher_and_the_last_is_flushed(
    local_dir: Path,
) -> None:
    """Mechanism: the flusher sleeps until the oldest queued release is due (`_flush_at`);
    before, every release woke it (a third of the loads paid a thread switch and a
    contended lock, +15 µs each). A release no request took along still goes on its own."""
    sc = start(local_dir)
    try:
        put_tcp(sc, key(1), b"\x01" * 4096)
        engine = LocalClient(local_dir, defer_releases=True, flush_after_s=1.0)
        wake = engine._wake = CountingCondition(engine._lock)  # type: ignore[arg-type]
        try:
            for _ in range(600):
                assert engine.release(engine.lease([key(1)]))  # queued, taken by the next
            assert engine.trusted_releases == 600
            assert sc.local is not None and sc.local.leases == 1  # the last one, queued
            assert wake.waits < 60, wake.waits
            deadline = time.monotonic() + 10
            while sc.local.leases:
                assert time.monotonic() < deadline, "the last release was never flushed"
                time.sleep(0.01)
        finally:
            engine.close()
    finally:
        sc.stop()
