"""Write-behind: pinned blocks get a disk copy while they are still in memory, so a
session's KV survives a crash (`kill -9`) of the sidecar."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx

from sidecar.blocks import BlockMeta
from sidecar.client import KVClient
from sidecar.disk import DiskTier
from sidecar.service import Sidecar
from sidecar.sessions import PinTable
from sidecar.settings import SidecarSettings
from sidecar.store import BlockStore
from sidecar.wire import Buffer
from tests.sidecar.helpers import SidecarFactory

KB, MB = 1024, 1024 * 1024


def key(i: int, session: str | None = None) -> str:
    k = f"m@1@0@{i:x}@bfloat16"
    return f"{k}@s%{session}" if session else k


def put(store: BlockStore, k: str, n: int = 10 * KB) -> bytes:
    data = os.urandom(n)
    assert store.put(BlockMeta(k, n, 1, 3, (2, 1, n // 4, 1)), bytearray(data))
    return data


def payload(store: BlockStore, k: str) -> bytes | None:
    found = store.get(k)
    return None if found is None else bytes(found[1])


def disk_store(root: Path, memory: int, disk: int) -> BlockStore:
    store = BlockStore(
        memory_bytes=memory,
        disk=DiskTier(root),
        disk_bytes=disk,
        pins=PinTable(root / "sessions.json"),
    )
    store.load_disk()
    return store


def files(root: Path) -> list[Path]:
    return list((root / "blocks").glob("*.kv"))


def test_pinned_blocks_get_a_disk_copy_and_stay_in_memory(tmp_path: Path) -> None:
    store = disk_store(tmp_path, memory=100 * KB, disk=1 << 20)
    store.pin("s", time.time() + 60)
    pinned = {key(i, "s"): put(store, key(i, "s")) for i in range(3)}
    unpinned = {key(10 + i, "other"): put(store, key(10 + i, "other")) for i in range(2)}

    assert store.write_behind() == 3
    s = store.stats()
    assert (s["memory_blocks"], s["disk_blocks"], s["disk_bytes_used"]) == (5, 3, 30 * KB)
    assert len(files(tmp_path)) == 3  # the unpinned blocks were not written
    assert store.metrics.write_behind_blocks._value.get() == 3
    assert store.metrics.write_behind_bytes._value.get() == 30 * KB
    assert store.write_behind() == 0  # nothing new to write
    assert {k: payload(store, k) for k in {**pinned, **unpinned}} == {**pinned, **unpinned}
    assert store.metrics.hits.labels("memory")._value.get() == 5  # all served from memory


def test_a_full_disk_gets_what_fits_and_loses_nothing(tmp_path: Path) -> None:
    store = disk_store(tmp_path, memory=30 * KB, disk=30 * KB)
    u = [put(store, key(i)) for i in range(2)]
    store.pin("s", time.time() + 60)
    p = [put(store, key(i, "s")) for i in range(3)]  # memory: p0..p2; disk: u0, u1
    assert store.stats()["disk_bytes_used"] == 20 * KB

    assert store.write_behind() == 1  # 10 KiB of free room: the oldest pinned block
    assert store.write_behind() == 0  # no room left, and none is made
    s = store.stats()
    assert (s["blocks"], s["disk_blocks"], s["disk_bytes_used"]) == (5, 3, 30 * KB)
    assert store.metrics.evictions.labels("disk")._value.get() == 0
    assert store.metrics.pinned_dropped_sessions._value.get() == 0
    assert [payload(store, key(i)) for i in range(2)] == u
    assert [payload(store, key(i, "s")) for i in range(3)] == p


def test_a_reopened_store_finds_the_written_blocks(tmp_path: Path) -> None:
    """A crash: no flush at the end, only what write-behind wrote (and the pins the reaper
    saved) is on disk."""
    store = disk_store(tmp_path, memory=1 << 20, disk=1 << 20)
    store.pin("s", time.time() + 60)
    data = {key(i, "s"): put(store, key(i, "s")) for i in range(4)}
    put(store, key(9))  # unpinned: memory only, lost in a crash
    store.reap()  # (saves the pins, as the reaper does every second)
    assert store.write_behind() == 4

    again = disk_store(tmp_path, memory=1 << 20, disk=1 << 20)
    assert {k: payload(again, k) for k in data} == data
    assert not again.exists(key(9))
    assert again.session_info("s")["pinned"] is True


def test_a_block_evicted_while_its_copy_is_written_is_written_once(tmp_path: Path) -> None:
    """PUTs push the block write-behind is writing out of memory meanwhile: it is not
    spilled a second time, its one file is counted once, and it reads back right."""
    store = disk_store(tmp_path, memory=20 * KB, disk=1 << 20)
    store.pin("s", time.time() + 60)
    p0 = put(store, key(0, "s"))
    put(store, key(1, "s"))
    assert store.disk is not None
    write = store.disk.write
    pushed: list[bytes] = []

    def write_during_puts(meta: BlockMeta, data: Buffer) -> Path:
        if not pushed:  # (outside the store's lock, as a concurrent connection would)
            pushed.extend(put(store, key(i, "s")) for i in (2, 3))  # p0, then p1 leave memory
        return write(meta, data)

    store.disk.write = write_during_puts  # type: ignore[method-assign]
    assert store.write_behind() == 1  # p0; p1 was spilled by the second PUT meanwhile
    s = store.stats()
    assert (s["memory_blocks"], s["disk_blocks"], s["disk_bytes_used"]) == (2, 2, 20 * KB)
    assert len(files(tmp_path)) == 2
    assert payload(store, key(0, "s")) == p0


def test_the_service_runs_write_behind_only_with_a_disk_tier(tmp_path: Path) -> None:
    def writers() -> int:
        return sum(t.name == "sidecar-write-behind" for t in threading.enumerate())

    before = writers()
    memory_only = Sidecar(SidecarSettings(port=0, memory_bytes=MB, write_behind_s=0.05)).start()
    try:
        assert writers() == before
    finally:
        memory_only.stop()
    sc = Sidecar(
        SidecarSettings(
            port=0, memory_bytes=MB, data_dir=tmp_path, disk_bytes=MB, write_behind_s=0.05
        )
    ).start()
    try:
        assert writers() == before + 1
        sc.store.pin("s", time.time() + 60)
        with KVClient("127.0.0.1", sc.port) as c:
            c.put(key(0, "s"), os.urandom(10 * KB), fmt=1, dtype=3, shape=(2, 1, 1, 0))
        deadline = time.monotonic() + 10
        while sc.metrics.write_behind_blocks._value.get() < 1:
            assert time.monotonic() < deadline, "write-behind never wrote the pinned block"
            time.sleep(0.02)
    finally:
        sc.stop()
    assert writers() == before


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_pinned_session_survives_kill_9(sidecar_process: SidecarFactory, tmp_path: Path) -> None:
    args = ("--data-dir", str(tmp_path / "d"), "--memory-bytes", str(MB), "--disk-bytes", str(MB))
    env = {"CTX_SIDECAR_WRITE_BEHIND_S": "0.1"}
    sc = sidecar_process(*args, env=env)
    port, control = sc.data_port, sc.port
    exp = time.time() + 600
    httpx.put(f"{sc.url}/sessions/sess", json={"expires_at": exp}).raise_for_status()
    blocks = {key(i, "sess"): os.urandom(64 * KB) for i in range(8)}
    with KVClient("127.0.0.1", port) as c:
        for k, data in blocks.items():
            c.put(k, data, fmt=1, dtype=3, shape=(2, 1, 1, 0))
        c.put(key(0, "idle"), os.urandom(64 * KB), fmt=1, dtype=3, shape=(2, 1, 1, 0))
        assert c.exists(key(0, "idle"))  # (every PUT before it is stored too)
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(f"{sc.url}/metrics").text
        if metric(text, "ctxcache_sidecar_write_behind_blocks_total") >= len(blocks):
            break
        assert time.monotonic() < deadline, "write-behind never wrote the session's blocks"
        time.sleep(0.05)
    assert metric(text, "ctxcache_sidecar_write_behind_bytes_total") == 8 * 64 * KB
    sc.kill()

    sc = sidecar_process(*args, env=env, data_port=port, control_port=control)
    with KVClient("127.0.0.1", port) as c:
        for k, data in blocks.items():
            block = c.get(k)
            assert block is not None, k
            assert bytes(block.data) == data
        assert c.get(key(0, "idle")) is None  # unpinned, memory only: lost with the process
