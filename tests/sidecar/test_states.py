"""A session's recurrent-state blocks (`sidecar.states`): the store keeps its newest few
and drops the older on the PUT of a newer; its KV blocks, other sessions' states, and keys
that only look alike are left alone."""

from __future__ import annotations

from pathlib import Path

from sidecar.blocks import BlockMeta
from sidecar.disk import DiskTier
from sidecar.protocol import DTYPE_UINT8, FMT_BINARY
from sidecar.states import is_state
from sidecar.store import BlockStore
from tests.sidecar.test_store import put

KB = 1024


def state_key(i: int, session: str, tag: str = "rs%1.abcd1234") -> str:
    return f"m#g0@1@0@{i:x}@bfloat16@{tag}@s%{session}"


def put_state(store: BlockStore, k: str, n: int = 8 * KB) -> None:
    assert store.put(BlockMeta(k, n, FMT_BINARY, DTYPE_UINT8, (1, 2, 4, n)), bytearray(n))


def test_a_session_keeps_its_newest_state_blocks_and_all_its_kv() -> None:
    store = BlockStore(memory_bytes=1 << 20, state_blocks=2)
    kv = [f"m@1@0@{i:x}@bfloat16@s%a" for i in range(3)]
    for k in kv:
        put(store, k)
    for turn in range(4):
        put_state(store, state_key(turn, "a"))
    assert [store.exists(state_key(t, "a")) for t in range(4)] == [False, False, True, True]
    assert all(store.exists(k) for k in kv)
    assert store.session_info("a")["blocks"] == 5  # 3 KV + the 2 newest states


def test_sessions_count_apart_and_a_state_stored_again_is_the_newest() -> None:
    store = BlockStore(memory_bytes=1 << 20, state_blocks=2)
    put_state(store, state_key(0, "a"))
    put_state(store, state_key(1, "a"))
    put_state(store, state_key(0, "b"))
    put_state(store, state_key(0, "a"))  # again: now the newest of "a"
    put_state(store, state_key(2, "a"))
    assert not store.exists(state_key(1, "a"))
    assert store.exists(state_key(0, "a")) and store.exists(state_key(2, "a"))
    assert store.exists(state_key(0, "b"))


def test_zero_keeps_every_state_and_lookalikes_are_not_states() -> None:
    store = BlockStore(memory_bytes=1 << 20, state_blocks=0)
    for turn in range(5):
        put_state(store, state_key(turn, "a"))
    assert all(store.exists(state_key(t, "a")) for t in range(5))
    n = 8 * KB
    # a BINARY block without the tag, a tagged KV block, one without a session: not states
    assert not is_state(
        BlockMeta(state_key(0, "a", "x%1"), n, FMT_BINARY, DTYPE_UINT8, (1, 1, 1, n))
    )
    assert not is_state(BlockMeta(state_key(0, "a"), n, 1, 3, (2, 1, 4, 1)))
    assert not is_state(
        BlockMeta("m@1@0@0@bfloat16@rs%1", n, FMT_BINARY, DTYPE_UINT8, (1, 1, 1, n))
    )


def test_a_dropped_state_on_disk_goes_with_its_file(tmp_path: Path) -> None:
    """A state block spilled to the disk tier is dropped there too (its file removed)."""
    store = BlockStore(
        memory_bytes=16 * KB, disk=DiskTier(tmp_path), disk_bytes=1 << 20, state_blocks=1
    )
    put_state(store, state_key(0, "a"), 12 * KB)
    put_state(store, state_key(1, "a"), 12 * KB)  # spills the first, then drops it
    store.flush()
    assert not store.exists(state_key(0, "a")) and store.exists(state_key(1, "a"))
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size >= 12 * KB]
    assert len(files) <= 1, files  # (the newest may be in memory or on disk)
