"""`CTX_SIDECAR_COLD_KV=fp8`: KV kept as fp8 with per-row scales, loaded back in its dtype."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import torch

from sidecar import coldkv
from sidecar.arena import Arena
from sidecar.blocks import BlockMeta
from sidecar.client import KVClient
from sidecar.disk import MAGIC_PACKED, DiskTier
from sidecar.protocol import (
    DTYPE_BFLOAT16,
    DTYPE_FLOAT8_E4M3FN,
    DTYPE_FLOAT8_E5M2,
    DTYPE_FLOAT16,
    DTYPE_FLOAT32,
    DTYPE_UINT8,
    FMT_ENGINE_BLOCKS,
    FMT_KV_2LTD,
    FMT_UNDEFINED,
)
from sidecar.service import Sidecar
from sidecar.settings import SidecarSettings
from sidecar.store import BlockStore
from tests.sidecar.helpers import SidecarFactory
from tests.utils import local_dir_fixture  # noqa: F401 (the local_dir fixture)

DTYPES = {
    DTYPE_BFLOAT16: torch.bfloat16,
    DTYPE_FLOAT16: torch.float16,
    DTYPE_FLOAT32: torch.float32,
}
SHAPE = (2, 3, 32, 128)  # [2, L, T, D]


def kv_block(
    i: int, dtype: int = DTYPE_BFLOAT16, shape: tuple[int, int, int, int] = SHAPE
) -> tuple[BlockMeta, torch.Tensor, bytearray]:
    """A KV_2LTD block of random KV with a few outliers, as the worker would PUT it."""
    gen = torch.Generator().manual_seed(i)
    x = torch.randn(*shape, generator=gen) * torch.rand(shape[-1], generator=gen) * 4
    x[0, 0, 0, 0] = 300.0  # an outlier: its row's scale, not the others'
    x = x.to(DTYPES[dtype])
    data = bytearray(x.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    key = f"m@1@0@{i:x}@bfloat16@s%sess"
    return BlockMeta(key, len(data), FMT_KV_2LTD, dtype, shape), x, data


def as_tensor(data: object, dtype: int, shape: tuple[int, ...]) -> torch.Tensor:
    raw = bytearray(memoryview(data).cast("B"))  # type: ignore[arg-type]
    return torch.frombuffer(raw, dtype=torch.uint8).view(DTYPES[dtype]).view(shape)


def assert_within_fp8(got: torch.Tensor, want: torch.Tensor) -> None:
    """Every element within e4m3's rounding of the original (half a unit in the last of 3
    mantissa bits: 2^-4 of the value, plus 2^-8 for the 16-bit dtypes' own rounding), or,
    in its row's subnormal range, 2^-10 of the row's scale."""
    want, got = want.float(), got.float()
    scale = want.abs().amax(dim=-1, keepdim=True) / coldkv.FP8_MAX
    bound = want.abs() * (2**-4 + 2**-8) + scale * 2**-9
    assert bool(((got - want).abs() <= bound).all())
    assert bool((got - want).abs().max() > 0)  # it is lossy: this really went through fp8


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_pack_round_trip_keeps_dtype_shape_length_within_fp8_rounding(dtype: int) -> None:
    meta, x, data = kv_block(1, dtype)
    packed = coldkv.pack(meta, data)
    assert packed is not None
    rows = SHAPE[0] * SHAPE[1] * SHAPE[2]
    assert len(packed) == coldkv.packed_length(rows, SHAPE[3])
    assert len(packed) < len(data) * (0.26 if dtype == DTYPE_FLOAT32 else 0.52)
    out = coldkv.unpack(meta, packed)
    assert len(out) == meta.length
    assert_within_fp8(as_tensor(out, dtype, SHAPE), x)


def test_engine_blocks_are_scaled_per_kernel_block_row() -> None:
    layers, blocks, elems = 2, 4, 512
    x = torch.randn(layers, blocks, elems).to(torch.bfloat16)
    data = bytearray(x.view(-1).view(torch.uint8).numpy().tobytes())
    meta = BlockMeta("k", len(data), FMT_ENGINE_BLOCKS, DTYPE_BFLOAT16, (layers, 64, elems, 77))
    assert coldkv.rows_of(meta) == (layers * blocks, elems)
    packed = coldkv.pack(meta, data)
    assert packed is not None
    assert_within_fp8(as_tensor(coldkv.unpack(meta, packed), DTYPE_BFLOAT16, x.shape), x)


@pytest.mark.parametrize("dtype", [DTYPE_FLOAT8_E4M3FN, DTYPE_FLOAT8_E5M2, DTYPE_UINT8])
def test_one_byte_payloads_are_stored_as_they_are(dtype: int) -> None:
    """An fp8 KV cache's blocks (or any 1-byte dtype) are never packed: nothing to gain."""
    data = bytearray(range(256)) * 32
    meta = BlockMeta("m@1@0@1@fp8@s%sess", len(data), FMT_KV_2LTD, dtype, (2, 4, 32, 32))
    assert coldkv.pack(meta, data) is None
    store = BlockStore(memory_bytes=1 << 20, cold_kv="fp8")
    assert store.put(meta, bytearray(data))
    found = store.get(meta.key)
    assert found is not None and bytes(found[1]) == bytes(data)
    assert store.session_info("sess")["bytes"] == len(data)


def test_what_does_not_pack_is_kept_as_it_came() -> None:
    meta, _x, data = kv_block(2)
    odd = BlockMeta(meta.key, meta.length, FMT_UNDEFINED, meta.dtype, meta.shape)
    short = BlockMeta(meta.key, meta.length - 2, FMT_KV_2LTD, meta.dtype, meta.shape)
    assert coldkv.pack(odd, data) is None  # a format we do not know
    assert coldkv.pack(short, data[:-2]) is None  # length and shape disagree
    nan = bytearray(data)
    nan[0:2] = bytes(torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.uint8))
    assert coldkv.pack(meta, nan) is None  # non-finite KV is never rounded into fp8
    store = BlockStore(memory_bytes=1 << 20, cold_kv="fp8")
    assert store.put(meta, bytearray(nan))
    found = store.get(meta.key)
    assert found is not None and bytes(found[1]) == bytes(nan)


def test_the_setting_is_off_by_default_and_blocks_come_back_exact() -> None:
    assert SidecarSettings().cold_kv == "off"
    store = BlockStore(memory_bytes=1 << 20)
    assert store.stats()["cold_kv"] == "off"
    meta, _x, data = kv_block(3)
    assert store.put(meta, bytearray(data))
    found = store.get(meta.key)
    assert found is not None and bytes(found[1]) == bytes(data)
    assert store.session_info("sess")["bytes"] == len(data)


def test_packed_blocks_take_half_the_budget_and_twice_the_sessions_fit() -> None:
    meta, _x, _data = kv_block(0)
    budget = 10 * meta.length
    plain, packed = BlockStore(memory_bytes=budget), BlockStore(memory_bytes=budget, cold_kv="fp8")
    for store in (plain, packed):
        for i in range(20):
            m, _x, data = kv_block(i)
            assert store.put(m, data)
    assert plain.stats()["blocks"] == 10
    assert packed.stats()["blocks"] == 19  # each takes 0.516 of its length
    assert packed.session_info("sess")["tokens"] == 19 * SHAPE[2]


def test_disk_tier_keeps_packed_blocks_across_a_restart(tmp_path: Path) -> None:
    """Spilled packed; read back by the next sidecar, with or without the setting."""
    meta, _x, _data = kv_block(0)
    store = BlockStore(
        memory_bytes=meta.length,
        disk=DiskTier(tmp_path),
        disk_bytes=1 << 20,
        cold_kv="fp8",
    )
    blocks = {i: kv_block(i) for i in range(6)}
    for m, _x, data in blocks.values():
        assert store.put(m, data)
    assert store.flush() > 0
    files = list((tmp_path / "blocks").glob("*.kv"))
    assert len(files) == 6
    assert all(f.read_bytes()[:8] == MAGIC_PACKED for f in files)
    assert all(f.stat().st_size < meta.length * 0.55 for f in files)
    for cold_kv in ("off", "fp8"):
        again = BlockStore(
            memory_bytes=meta.length, disk=DiskTier(tmp_path), disk_bytes=1 << 20, cold_kv=cold_kv
        )
        assert again.load_disk() == 6
        # the budget counts packed bytes
        assert again.disk_used == sum(len(coldkv.pack(m, d) or b"") for m, _x, d in blocks.values())
        for m, x, _data in blocks.values():
            found = again.get(m.key)
            assert found is not None and found[0] == m
            assert_within_fp8(as_tensor(found[1], m.dtype, SHAPE), x)


def test_encrypted_disk_tier_with_packed_blocks(tmp_path: Path) -> None:
    meta, x, data = kv_block(4)
    aes = bytes(range(32))
    store = BlockStore(
        memory_bytes=1, disk=DiskTier(tmp_path, aes_key=aes), disk_bytes=1 << 20, cold_kv="fp8"
    )
    assert store.put(meta, data)  # larger than memory: straight to disk
    found = store.get(meta.key)
    assert found is not None
    assert_within_fp8(as_tensor(found[1], meta.dtype, SHAPE), x)


def test_a_packed_block_that_does_not_unpack_is_a_miss_and_dropped() -> None:
    store = BlockStore(memory_bytes=1 << 20, cold_kv="fp8")
    meta, _x, data = kv_block(5)
    assert store.put(meta, data)
    entry = store._index.blocks[meta.key]  # (corrupt it in place)
    assert entry.packed
    bad = bytearray(entry.data)  # type: ignore[arg-type]
    bad[coldkv.HEADER.size : coldkv.HEADER.size + 4] = b"\x00\x00\xc0\x7f"  # a scale of nan
    entry.data = bad
    assert store.get(meta.key) is None
    assert not store.exists(meta.key)
    assert store.metrics.corrupt._value.get() == 1


@pytest.mark.parametrize(
    "damage",
    ["magic", "dtype", "rows", "truncated"],
)
def test_unpack_refuses_packed_bytes_that_are_not_this_block(damage: str) -> None:
    meta, _x, data = kv_block(6)
    packed = coldkv.pack(meta, data)
    assert packed is not None
    if damage == "magic":
        packed[0:4] = b"XXXX"
    elif damage == "dtype":
        packed[5] = DTYPE_FLOAT32
    elif damage == "rows":
        packed[8:12] = (1).to_bytes(4, "little")
    else:
        del packed[-1]
    with pytest.raises(coldkv.BadPacked):
        coldkv.unpack(meta, packed)


def test_a_disk_file_whose_packed_payload_is_wrong_is_a_miss(tmp_path: Path) -> None:
    """A file with a good checksum over a payload that is not this block's packed form."""
    meta, _x, _data = kv_block(7)
    disk = DiskTier(tmp_path)
    other, _y, other_data = kv_block(8, shape=(2, 3, 32, 32))
    wrong = coldkv.pack(other, other_data)
    assert wrong is not None
    disk.write(meta, wrong, packed=True)
    store = BlockStore(memory_bytes=1 << 20, disk=disk, disk_bytes=1 << 20, cold_kv="fp8")
    assert store.load_disk() == 1
    assert store.get(meta.key) is None
    assert not store.exists(meta.key)
    assert list((tmp_path / "blocks").glob("*.kv")) == []


def test_a_lease_of_a_packed_block_hands_the_engine_its_own_dtype(local_dir: Path) -> None:
    """With a shared region a packed block stays packed in it; a lease unpacks it into a
    slot of its own, and a load through the region reads KV, never fp8 bytes."""
    arena = Arena(local_dir, 4 << 20)
    try:
        store = BlockStore(memory_bytes=2 << 20, arena=arena, cold_kv="fp8")
        meta, x, data = kv_block(9)
        slot = store.new_buffer(meta.length)
        memoryview(slot).cast("B")[:] = data  # type: ignore[arg-type]
        assert store.put(meta, slot)
        entry = store._index.blocks[meta.key]
        assert entry.packed and arena.holds(entry.data)  # kept packed, in the region
        for got in (store.lease_many([meta.key])[0], store.lease_many([meta.key])[0]):
            assert isinstance(got, tuple)
            found_meta, leased, _offset = got
            assert found_meta == meta and len(leased) == meta.length and arena.holds(leased)
            assert_within_fp8(as_tensor(leased, meta.dtype, SHAPE), x)
    finally:
        arena.close()


def test_over_lm_the_client_gets_its_header_and_dtype_back() -> None:
    sc = Sidecar(SidecarSettings(port=0, memory_bytes=64 << 20, cold_kv="fp8")).start()
    try:
        meta, x, data = kv_block(10)
        with KVClient("127.0.0.1", sc.port) as c:
            c.put(meta.key, data, fmt=meta.fmt, dtype=meta.dtype, shape=meta.shape)
            block = c.get(meta.key)
        assert block is not None
        assert (block.fmt, block.dtype, block.shape) == (meta.fmt, meta.dtype, meta.shape)
        assert len(block.data) == meta.length
        assert_within_fp8(as_tensor(block.data, meta.dtype, SHAPE), x)
        deadline = time.time() + 5
        while sc.store.session_info("sess")["bytes"] == 0 and time.time() < deadline:
            time.sleep(0.01)
        assert sc.store.session_info("sess")["bytes"] < meta.length * 0.55
    finally:
        sc.stop()


def test_a_sidecar_process_restarted_without_the_setting_serves_its_packed_blocks(
    sidecar_process: SidecarFactory, tmp_path: Path
) -> None:
    """`ctxcache sidecar --cold-kv fp8` with a disk tier, stopped (its memory flushed) and
    started again without the flag: the blocks come back, in their dtype, from the packed
    files; the session's bytes are the packed ones across the restart."""
    args = ("--data-dir", str(tmp_path / "data"), "--disk-bytes", str(64 << 20))
    sc = sidecar_process(*args, "--cold-kv", "fp8")
    blocks = {i: kv_block(i) for i in range(4)}
    with KVClient("127.0.0.1", sc.data_port) as c:
        for m, _x, data in blocks.values():
            c.put(m.key, data, fmt=m.fmt, dtype=m.dtype, shape=m.shape)
        assert c.exists(blocks[3][0].key)
    httpx.put(f"{sc.url}/sessions/sess", json={"expires_at": time.time() + 600}).raise_for_status()
    packed = httpx.get(f"{sc.url}/sessions/sess").json()["bytes"]
    assert packed < 0.52 * sum(m.length for m, _x, _d in blocks.values())
    sc.stop()  # SIGTERM: memory-only blocks are flushed to disk

    sc = sidecar_process(*args, data_port=sc.data_port, control_port=sc.port)
    assert httpx.get(f"{sc.url}/stats").json()["cold_kv"] == "off"
    with KVClient("127.0.0.1", sc.data_port) as c:
        for m, x, _data in blocks.values():
            block = c.get(m.key)
            assert block is not None
            assert (block.fmt, block.dtype, block.shape) == (m.fmt, m.dtype, m.shape)
            assert_within_fp8(as_tensor(block.data, m.dtype, SHAPE), x)
    assert httpx.get(f"{sc.url}/sessions/sess").json()["bytes"] == packed
