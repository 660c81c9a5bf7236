"""BlockStore policy: LRU eviction, spill to disk, pins, expiry, delete, restart."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sidecar.blocks import BlockMeta
from sidecar.disk import DiskTier
from sidecar.sessions import PinTable
from sidecar.store import BlockStore

KB = 1024


def key(i: int, session: str | None = None) -> str:
    k = f"m@1@0@{i:x}@bfloat16"
    return f"{k}@s%{session}" if session else k


def meta(k: str, n: int) -> BlockMeta:
    return BlockMeta(k, n, 1, 3, (2, 1, n // 4, 1))


def put(store: BlockStore, k: str, n: int = 10 * KB) -> bytes:
    data = os.urandom(n)
    assert store.put(meta(k, n), bytearray(data))
    return data


def payload(store: BlockStore, k: str) -> bytes | None:
    found = store.get(k)
    return None if found is None else bytes(found[1])


def disk_store(root: Path, memory: int, disk: int, aes_key: bytes | None = None) -> BlockStore:
    store = BlockStore(
        memory_bytes=memory,
        disk=DiskTier(root, aes_key=aes_key),
        disk_bytes=disk,
        pins=PinTable(root / "sessions.json"),
    )
    store.load_disk()
    return store


def test_memory_lru_evicts_least_recently_used() -> None:
    store = BlockStore(memory_bytes=30 * KB)
    a, b, c = (put(store, key(i)) for i in range(3))
    assert payload(store, key(0)) == a  # 0 is now more recent than 1
    d = put(store, key(3))
    assert not store.exists(key(1))
    assert payload(store, key(0)) == a
    assert payload(store, key(2)) == c
    assert payload(store, key(3)) == d
    assert store.stats()["memory_bytes_used"] == 30 * KB
    assert b  # (evicted)


def test_pinned_blocks_survive_pressure_and_unpinned_go_first() -> None:
    store = BlockStore(memory_bytes=30 * KB)
    store.pin("s1", time.time() + 60)
    pinned = put(store, key(0, "s1"))
    for i in range(1, 10):
        put(store, key(i))
    assert payload(store, key(0, "s1")) == pinned
    assert store.session_info("s1") | {"expires_at": None} == {
        "session": "s1",
        "blocks": 1,
        "bytes": 10 * KB,
        "tokens": 2560,
        "pinned": True,
        "expires_at": None,
    }


def test_reserve_policy_refuses_new_pinned_block_instead_of_evicting() -> None:
    store = BlockStore(memory_bytes=30 * KB, pin_policy="reserve")
    store.pin("a", time.time() + 60)
    store.pin("b", time.time() + 60)
    kept = [put(store, key(i, "a")) for i in range(3)]
    assert not store.put(meta(key(9, "b"), 10 * KB), bytearray(10 * KB))
    assert not store.exists(key(9, "b"))
    assert [payload(store, key(i, "a")) for i in range(3)] == kept
    assert store.metrics.refused.labels("pin_budget")._value.get() == 1
    # an unpinned block does not push pinned KV out either: it is the one that goes
    put(store, key(20))
    assert [payload(store, key(i, "a")) for i in range(3)] == kept


def test_pin_after_put_protects_existing_blocks() -> None:
    store = BlockStore(memory_bytes=30 * KB)
    early = put(store, key(0, "late"))
    store.pin("late", time.time() + 60)
    for i in range(1, 6):
        put(store, key(i))
    assert payload(store, key(0, "late")) == early
    assert store.stats()["pinned_bytes"] == 10 * KB


def test_unpinned_session_blocks_are_plain_lru() -> None:
    store = BlockStore(memory_bytes=20 * KB)
    put(store, key(0, "never-pinned"))
    put(store, key(1))
    put(store, key(2))
    assert not store.exists(key(0, "never-pinned"))
    assert store.session_info("never-pinned")["blocks"] == 0


def test_expiry_drops_blocks_and_bytes_return_to_baseline() -> None:
    store = BlockStore(memory_bytes=1 << 20)
    put(store, key(100))
    baseline = store.stats()["memory_bytes_used"]
    now = time.time()
    store.pin("s", now + 5)
    for i in range(4):
        put(store, key(i, "s"))
    assert store.stats()["memory_bytes_used"] == baseline + 40 * KB
    assert store.reap(now + 1) == 0
    assert store.session_info("s")["blocks"] == 4
    assert store.reap(now + 6) == 1
    assert store.session_info("s") == {
        "session": "s",
        "blocks": 0,
        "bytes": 0,
        "tokens": 0,
        "pinned": False,
        "expires_at": None,
    }
    assert store.stats()["memory_bytes_used"] == baseline
    assert store.stats()["pinned_bytes"] == 0
    assert store.exists(key(100))


def test_drop_session_removes_from_every_tier(tmp_path: Path) -> None:
    store = disk_store(tmp_path, memory=20 * KB, disk=1 << 20)
    store.pin("s", time.time() + 60)
    for i in range(5):  # 3 of them spill to disk
        put(store, key(i, "s"))
    put(store, key(50))
    assert store.stats()["disk_blocks"] >= 3
    assert store.drop_session("s") == (5, 50 * KB)
    assert all(not store.exists(key(i, "s")) for i in range(5))
    assert store.exists(key(50))
    files = list((tmp_path / "blocks").iterdir())
    assert len(files) == store.stats()["disk_blocks"] <= 1
    assert store.session_info("s")["bytes"] == 0


def test_spill_to_disk_and_promote_back(tmp_path: Path) -> None:
    store = disk_store(tmp_path, memory=20 * KB, disk=1 << 20)
    data = [put(store, key(i)) for i in range(6)]
    s = store.stats()
    assert s["memory_bytes_used"] <= 20 * KB
    assert s["disk_blocks"] == 4
    assert [payload(store, key(i)) for i in range(6)] == data  # disk hits, promoted
    assert store.metrics.hits.labels("disk")._value.get() >= 4


def test_disk_lru_eviction_respects_budget(tmp_path: Path) -> None:
    store = disk_store(tmp_path, memory=10 * KB, disk=30 * KB)
    for i in range(8):
        put(store, key(i))
    s = store.stats()
    assert s["disk_bytes_used"] <= 30 * KB
    assert not store.exists(key(0))
    assert store.exists(key(7))
    assert store.metrics.evictions.labels("disk")._value.get() > 0


def test_block_larger_than_memory_goes_straight_to_disk(tmp_path: Path) -> None:
    store = disk_store(tmp_path, memory=10 * KB, disk=1 << 20)
    big = put(store, key(1), 100 * KB)
    assert store.stats()["memory_bytes_used"] == 0
    assert payload(store, key(1)) == big
    assert not BlockStore(memory_bytes=10 * KB).put(meta(key(2), 20 * KB), bytearray(20 * KB))


def test_restart_rebuilds_index_from_disk(tmp_path: Path) -> None:
    store = disk_store(tmp_path, memory=20 * KB, disk=1 << 20)
    store.pin("s", time.time() + 60)
    data = {key(i, "s"): put(store, key(i, "s")) for i in range(6)}
    assert store.flush() == 2  # what was still only in memory
    store.reap()  # saves the pins
    again = disk_store(tmp_path, memory=20 * KB, disk=1 << 20)
    assert {k: payload(again, k) for k in data} == data
    got = again.get(key(3, "s"))
    assert got is not None and got[0] == meta(key(3, "s"), 10 * KB)
    assert again.session_info("s")["pinned"] is True
    assert again.stats()["pinned_bytes"] == 60 * KB


def test_flipped_byte_on_disk_is_a_miss_and_removed(tmp_path: Path) -> None:
    store = disk_store(tmp_path, memory=10 * KB, disk=1 << 20)
    put(store, key(0))
    put(store, key(1))  # pushes 0 to disk
    (victim,) = list((tmp_path / "blocks").iterdir())
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 0x01
    victim.write_bytes(raw)
    assert store.get(key(0)) is None
    assert not store.exists(key(0))
    assert not victim.exists()
    assert store.metrics.corrupt._value.get() == 1


def test_encryption_at_rest(tmp_path: Path) -> None:
    aes = os.urandom(32)
    store = disk_store(tmp_path, memory=10 * KB, disk=1 << 20, aes_key=aes)
    marker = b"plaintext-marker" * 64
    assert store.put(meta(key(0), len(marker)), bytearray(marker))
    store.flush()
    (f,) = list((tmp_path / "blocks").iterdir())
    assert marker[:16] not in f.read_bytes()
    again = disk_store(tmp_path, memory=10 * KB, disk=1 << 20, aes_key=aes)
    assert payload(again, key(0)) == marker
    wrong = disk_store(tmp_path, memory=10 * KB, disk=1 << 20, aes_key=os.urandom(32))
    assert wrong.get(key(0)) is None  # authentication fails: a miss, and removed
    assert not f.exists()


def test_stray_temp_and_truncated_files_are_cleaned_at_start(tmp_path: Path) -> None:
    store = disk_store(tmp_path, memory=10 * KB, disk=1 << 20)
    kept = put(store, key(0))
    put(store, key(1))
    put(store, key(2))
    files = sorted((tmp_path / "blocks").iterdir(), key=lambda p: p.stat().st_mtime)
    assert len(files) == 2
    (tmp_path / "blocks" / ".abc.kv.tmp").write_bytes(b"partial")
    with open(files[1], "r+b") as f:
        f.truncate(files[1].stat().st_size - 10)
    again = disk_store(tmp_path, memory=10 * KB, disk=1 << 20)
    assert payload(again, key(0)) == kept
    assert again.get(key(1)) is None
    assert sorted(p.name for p in (tmp_path / "blocks").iterdir()) == [files[0].name]


@pytest.mark.parametrize("aes", [None, b"k" * 32])
def test_overwrite_replaces_block_in_every_tier(tmp_path: Path, aes: bytes | None) -> None:
    store = disk_store(tmp_path, memory=10 * KB, disk=1 << 20, aes_key=aes)
    put(store, key(0))
    put(store, key(1))  # 0 on disk now
    new = put(store, key(0), 4 * KB)
    assert payload(store, key(0)) == new
    store.flush()
    again = disk_store(tmp_path, memory=10 * KB, disk=1 << 20, aes_key=aes)
    assert payload(again, key(0)) == new


def test_concurrent_spill_promote_overwrite_keep_data_right(tmp_path: Path) -> None:
    """16 threads PUT, overwrite and GET through a memory tier far smaller than the data,
    so blocks spill, get promoted and are replaced while other threads read them."""
    import random
    import threading

    store = disk_store(tmp_path, memory=64 * KB, disk=64 << 20)
    errors: list[str] = []

    def worker(n: int) -> None:
        rng = random.Random(n)
        latest: dict[str, bytes] = {}
        for i in range(60):
            k = key(n * 1000 + rng.randrange(6))
            if latest and rng.random() < 0.5:
                k = rng.choice(list(latest))
                if payload(store, k) != latest[k]:
                    errors.append(f"thread {n}: wrong or missing {k} at step {i}")
            else:
                latest[k] = put(store, k, rng.choice((KB, 8 * KB, 20 * KB)))
        for k, want in latest.items():
            if payload(store, k) != want:
                errors.append(f"thread {n}: final read of {k} wrong")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[:5]
    s = store.stats()
    assert s["memory_bytes_used"] <= 64 * KB
    on_disk = DiskTier(tmp_path).scan()  # every file is whole, one per block the index counts
    assert len(on_disk) == s["disk_blocks"]
    assert sum(e.meta.length for e in on_disk) == s["disk_bytes_used"]
    assert len({e.meta.key for e in on_disk}) == len(on_disk)


def dropped(store: BlockStore) -> tuple[float, float, float]:
    m = store.metrics
    return (
        m.pinned_dropped.labels("memory")._value.get(),
        m.pinned_dropped.labels("disk")._value.get(),
        m.pinned_dropped_sessions._value.get(),
    )


def test_lru_policy_drops_the_least_recently_used_pinned_session_for_a_new_one() -> None:
    """Memory only, full of idle pinned sessions: the active session's new blocks are
    stored, the least recently used idle session makes room (all its blocks: a prefix
    without its start is worth nothing), and keeps its pin for its next turn."""
    store = BlockStore(memory_bytes=40 * KB)  # pin_policy "lru" is the default
    for s in ("old", "newer"):
        store.pin(s, time.time() + 60)
        put(store, key(0, s))
        put(store, key(1, s))
    store.pin("active", time.time() + 60)
    fresh = put(store, key(0, "active"))
    assert store.session_info("old")["blocks"] == 0
    assert store.session_info("old")["pinned"] is True
    assert store.session_info("newer")["blocks"] == 2
    assert payload(store, key(0, "active")) == fresh
    assert dropped(store) == (2, 0, 1)
    assert store.stats()["memory_bytes_used"] <= 40 * KB
    # the dropped session's next turn recomputes its KV, stored pinned again
    put(store, key(0, "old"))
    assert store.session_info("old") | {"expires_at": None} == {
        "session": "old",
        "blocks": 1,
        "bytes": 10 * KB,
        "tokens": 2560,
        "pinned": True,
        "expires_at": None,
    }
    assert store.metrics.refused.labels("pin_budget")._value.get() == 0


def test_lru_policy_a_read_makes_a_session_recent() -> None:
    store = BlockStore(memory_bytes=30 * KB)
    for s in ("a", "b", "c"):
        store.pin(s, time.time() + 60)
        put(store, key(0, s))
    assert payload(store, key(0, "a")) is not None  # a is now the most recent
    store.pin("d", time.time() + 60)
    put(store, key(0, "d"))
    assert [store.exists(key(0, s)) for s in "abcd"] == [True, False, True, True]


def test_lru_policy_spills_to_disk_first_then_drops_from_disk(tmp_path: Path) -> None:
    store = disk_store(tmp_path, memory=20 * KB, disk=40 * KB)
    sessions = [f"idle{i}" for i in range(3)]
    for s in sessions:  # 60 KB of pinned KV: memory holds idle2's blocks, disk the rest
        store.pin(s, time.time() + 60)
        put(store, key(0, s))
        put(store, key(1, s))
    assert dropped(store) == (0, 0, 0)
    assert store.stats()["disk_bytes_used"] == 40 * KB
    assert store.session_info("idle0")["blocks"] == 2  # on disk, still there
    store.pin("active", time.time() + 60)
    data = [put(store, key(i, "active")) for i in range(2)]
    # idle2 spilled from memory to disk, and the disk made room by dropping idle0
    assert store.session_info("idle0")["blocks"] == 0
    assert [store.session_info(s)["blocks"] for s in sessions[1:]] == [2, 2]
    assert dropped(store) == (0, 2, 1)
    assert [payload(store, key(i, "active")) for i in range(2)] == data
    s = store.stats()
    assert s["memory_bytes_used"] <= 20 * KB and s["disk_bytes_used"] <= 40 * KB
    assert len(list((tmp_path / "blocks").iterdir())) == s["disk_blocks"]


def test_lru_policy_the_session_being_written_goes_last() -> None:
    """Its own older blocks are the least recently used ones, but the PUT of its next
    block drops another session rather than the start of its own prefix."""
    store = BlockStore(memory_bytes=30 * KB)
    store.pin("writer", time.time() + 60)
    store.pin("other", time.time() + 60)
    first = put(store, key(0, "writer"))
    put(store, key(0, "other"))
    put(store, key(1, "other"))
    put(store, key(1, "writer"))
    assert store.session_info("other")["blocks"] == 0
    assert payload(store, key(0, "writer")) == first
    assert store.exists(key(1, "writer"))


def test_lru_policy_never_drops_a_block_being_read_from_disk(tmp_path: Path) -> None:
    """While a block is read from the disk tier (outside the store's lock), another
    session's PUT needs room: the block being read is not the one dropped."""

    during_read: list[Callable[[], object]] = []

    class ReadWithPressure(DiskTier):
        def read(self, m: BlockMeta, path: Path) -> bytearray | bytes:
            while during_read:
                during_read.pop()()
            return super().read(m, path)

    disk = ReadWithPressure(tmp_path)
    store = BlockStore(memory_bytes=10 * KB, disk=disk, disk_bytes=20 * KB)
    store.pin("reader", time.time() + 60)
    store.pin("other", time.time() + 60)
    wanted = put(store, key(0, "reader"))  # oldest: the first candidate to drop
    put(store, key(0, "other"))
    put(store, key(1, "other"))  # memory: other1; disk: reader0, other0 (full)
    store.pin("newcomer", time.time() + 60)
    during_read.append(lambda: put(store, key(0, "newcomer")))
    assert payload(store, key(0, "reader")) == wanted
    assert store.exists(key(0, "newcomer"))
    # the oldest block that was not being read went, with its session (other1 was being
    # spilled from memory at that moment: it stays)
    assert not store.exists(key(0, "other"))
    assert dropped(store) == (0, 1, 1)


def test_reserve_policy_keeps_pinned_blocks_over_budget_when_disk_is_full(
    tmp_path: Path,
) -> None:
    store = disk_store(tmp_path, memory=10 * KB, disk=10 * KB)
    store.pin_policy = "reserve"
    store.pin("a", time.time() + 60)
    put(store, key(0, "a"))
    put(store, key(1, "a"))  # 0 spills; the pin budget (20 KB) is now full
    assert not store.put(meta(key(2, "a"), 10 * KB), bytearray(10 * KB))
    assert dropped(store) == (0, 0, 0)
    assert store.session_info("a")["blocks"] == 2


def test_lru_policy_drops_disk_copies_of_blocks_in_memory_before_any_session(
    tmp_path: Path,
) -> None:
    store = disk_store(tmp_path, memory=20 * KB, disk=30 * KB)
    for s in ("a", "b"):
        store.pin(s, time.time() + 60)
    put(store, key(0, "a"))
    put(store, key(1, "a"))
    put(store, key(0, "b"))
    put(store, key(1, "b"))  # memory: b0 b1; disk: a0 a1
    assert payload(store, key(0, "a")) is not None  # promoted: in memory, its disk copy kept
    assert store.stats()["disk_bytes_used"] == 30 * KB  # a0 (copy), a1, b0
    store.pin("c", time.time() + 60)
    put(store, key(0, "c"))  # memory is full again: a block spills, the disk needs room
    assert dropped(store) == (0, 0, 0)
    assert all(store.session_info(s)["blocks"] == 2 for s in "ab")


def test_lru_policy_a_session_larger_than_memory_keeps_its_newest_blocks() -> None:
    """Nothing else left to drop: the writing session gives up its oldest blocks one at a
    time, and every PUT is stored."""
    store = BlockStore(memory_bytes=30 * KB)
    store.pin("huge", time.time() + 60)
    data = [put(store, key(i, "huge")) for i in range(5)]
    assert [store.exists(key(i, "huge")) for i in range(5)] == [False, False, True, True, True]
    assert [payload(store, key(i, "huge")) for i in range(2, 5)] == data[2:]
    assert store.stats()["memory_bytes_used"] == 30 * KB
    assert dropped(store) == (2, 0, 2)
