"""fp8 KV caches (`--kv-cache-dtype fp8|fp8_e4m3|fp8_e5m2`) through the connector, with
vLLM's real CPU cache write (`cpu_attn_reshape_and_cache`, quantising with k/v scales).

What a user would notice: the layout probe learns an fp8 cache, so the connector serves it;
a load writes back exactly the bytes vLLM's own write stored; keys and payloads name the
fp8 format, so a bf16 engine never reads an fp8 block (nor e5m2 an e4m3 one) and a payload
of another dtype is a miss; the shared-memory path, lm:// and the disk tier carry the bytes
unchanged, at half of bf16's bytes per token.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sidecar.protocol import DTYPE_BFLOAT16, DTYPE_FLOAT8_E4M3FN, DTYPE_FLOAT8_E5M2
from sidecar.service import Sidecar
from sidecar.settings import SidecarSettings
from tests.utils import local_dir_fixture, require_vllm  # noqa: F401 (the local_dir fixture)
from vllm_connector.config import ConnectorConfig
from vllm_connector.kvdtype import FP8_CACHE_DTYPES, cache_views, probe_writer
from vllm_connector.layout import BlockLayout, CacheWriter, gather, probe_layout, scatter
from vllm_connector.layout import token_slots as slots_of
from vllm_connector.plan import LoadSpec, Piece, StoreSpec
from vllm_connector.scheduler import StepPlan
from vllm_connector.worker import WorkerSide
from worker.kv.layout import TORCH_TO_KEY_NAME, KVShape

N, HEADS, DIM, LAYERS, BLOCKS = 32, 2, 32, 2, 20  # the CPU backend's blocks: multiples of 32
TOKENS = 150  # 4 whole blocks and a partial one
SRC = [0, 1, 2, 3, 4]
DST = [17, 9, 12, 6, 15]


def vllm_write(cache_dtype: str, source: torch.dtype, scales: tuple[float, float]) -> CacheWriter:
    """vLLM's CPU `do_kv_cache_update` into a uint8 cache, for the ISA it picks here."""
    require_vllm()
    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        pytest.skip("vLLM's CPU fp8 KV cache needs AVX-512 or AMX")
    with warnings.catch_warnings():  # vLLM's imports warn (torch.jit deprecations)
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import (  # type: ignore[attr-defined]
            _get_attn_isa,
        )

    isa = _get_attn_isa(source, N, DIM, cache_dtype)
    k_scale, v_scale = scales

    def write(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        assert cache.dtype == (source if cache_dtype == "auto" else torch.uint8)
        assert k.dtype == source
        blocks, heads, tokens, _ = cache.shape
        key_cache, value_cache = cache.view(blocks, heads, tokens * 2, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            k,
            v,
            key_cache,
            value_cache,
            slots,
            isa,
            k_scale=k_scale,
            v_scale=v_scale,
            kv_cache_dtype=cache_dtype,
        )

    return write


def fp8_cache() -> torch.Tensor:
    """vLLM's CPU fp8 cache: uint8 `[blocks, H, N, 2*D]`, random bytes (no NaN pattern)."""
    return torch.randint(0, 0x70, (BLOCKS, HEADS, N, 2 * DIM), dtype=torch.uint8)


def exact_kv(tokens: int, dtype: torch.dtype, scales: tuple[float, float]) -> torch.Tensor:
    """K and V `[2, T, H, D]` (float32) whose quantised values are exact fp8 numbers."""
    raw = torch.randint(0, 0x70, (2, tokens, HEADS, DIM), dtype=torch.uint8)
    sign = (torch.randint(0, 2, raw.shape, dtype=torch.uint8) << 7) * (raw > 0)  # (vLLM's
    # write stores -0 as +0)
    values = (raw | sign).view(dtype).to(torch.float32)
    return values * torch.tensor(scales).view(2, 1, 1, 1)


def flat_slots(blocks: list[int]) -> torch.Tensor:
    """vLLM's slot mapping of tokens `0..TOKENS` in `blocks`."""
    return torch.tensor(blocks).repeat_interleave(N)[:TOKENS] * N + torch.arange(TOKENS) % N


CASES = [
    ("fp8", torch.bfloat16, (1.0, 1.0)),
    ("fp8_e4m3", torch.float32, (1.0, 1.0)),
    ("fp8_e5m2", torch.bfloat16, (1.0, 1.0)),
    ("fp8", torch.bfloat16, (0.5, 2.0)),  # per-tensor scales from a checkpoint
    ("fp8_e5m2", torch.float32, (0.25, 4.0)),
    ("fp8", torch.bfloat16, (0.37, 1.9)),  # not powers of two: the probe still holds
]


def learned(
    cache_dtype: str, source: torch.dtype, scales: tuple[float, float]
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[BlockLayout], CacheWriter]:
    """Caches (uint8, and their float8 views) and the layouts the probe learned of them."""
    dtype = FP8_CACHE_DTYPES[cache_dtype]
    write = vllm_write(cache_dtype, source, scales)
    raw = [fp8_cache() for _ in range(LAYERS)]
    views = list(cache_views({str(i): c for i, c in enumerate(raw)}, dtype).values())
    probe = probe_writer(write, source, scales)
    layouts = [probe_layout(view, probe, HEADS, DIM) for view in views]
    return raw, views, layouts, write


@pytest.mark.parametrize(("cache_dtype", "source", "scales"), CASES)
def test_the_probe_learns_an_fp8_cache_from_vllms_own_write(
    cache_dtype: str, source: torch.dtype, scales: tuple[float, float]
) -> None:
    """gather reads what vLLM's fp8 write stored, and scatter writes the bytes it would."""
    dtype = FP8_CACHE_DTYPES[cache_dtype]
    raw, views, layouts, write = learned(cache_dtype, source, scales)
    if scales[0] != round(scales[0]) and 1 / scales[0] != round(1 / scales[0]):
        return  # (values times a scale that is no power of two are not exact: probe only)
    kv = exact_kv(TOKENS, dtype, scales)
    src = slots_of(SRC, N, N, 0, TOKENS)
    dst = slots_of(DST, N, N, 0, TOKENS)
    for cache in raw:
        write(kv[0].to(source), kv[1].to(source), cache, flat_slots(SRC))
    got = gather(views, layouts, src)  # [2, L, H, T, D] in fp8
    want = (kv / torch.tensor(scales).view(2, 1, 1, 1)).to(dtype)  # exact: no rounding
    for layer in range(LAYERS):
        want_bytes = want.permute(0, 2, 1, 3).contiguous().view(torch.uint8)
        assert torch.equal(got[:, layer].contiguous().view(torch.uint8), want_bytes)
    # scatter into other blocks == vLLM writing the same K/V there
    reference = [c.clone() for c in raw]
    for cache in reference:
        write(kv[0].to(source), kv[1].to(source), cache, flat_slots(DST))
    scatter(views, layouts, dst, got)
    for cache, ref in zip(raw, reference, strict=True):
        assert torch.equal(cache, ref)


def test_a_probe_digit_base_past_what_fp8_holds_would_be_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control: with bf16's digit base, e4m3 cannot hold the probe's values (17..128
    round), and the probe says so instead of learning a wrong layout."""
    from vllm_connector import layout

    monkeypatch.setattr(layout, "_FP8_DIGIT_BASE", {})
    with pytest.raises(layout.LayoutError):
        learned("fp8", torch.bfloat16, (1.0, 1.0))


@pytest.mark.parametrize(
    ("dtype", "name", "code"),
    [
        (torch.float8_e4m3fn, "fp8_e4m3fn", DTYPE_FLOAT8_E4M3FN),
        (torch.float8_e5m2, "fp8_e5m2", DTYPE_FLOAT8_E5M2),
    ],
)
def test_keys_and_payloads_name_the_fp8_format_and_halve_bf16s_bytes(
    dtype: torch.dtype, name: str, code: int
) -> None:
    fp8, bf16 = KVShape(LAYERS, HEADS, DIM, dtype), KVShape(LAYERS, HEADS, DIM, torch.bfloat16)
    assert TORCH_TO_KEY_NAME[dtype] == name  # LMCache's name of this torch dtype
    assert fp8.dtype_code == code and bf16.dtype_code == DTYPE_BFLOAT16
    assert 2 * fp8.bytes_per_token() == bf16.bytes_per_token() == 2 * 2 * LAYERS * HEADS * DIM
    kv = torch.randint(0, 0x70, (2, LAYERS, HEADS, 64, DIM), dtype=torch.uint8).view(dtype)
    wire = fp8.to_wire(kv)
    back = fp8.from_wire(wire, 1, code, fp8.wire_shape(64), 64)
    assert back is not None and torch.equal(back.view(torch.uint8), kv.view(torch.uint8))
    # the same bytes under another dtype's header: refused, never reinterpreted
    assert fp8.from_wire(wire, 1, DTYPE_BFLOAT16, fp8.wire_shape(64), 64) is None
    other = DTYPE_FLOAT8_E5M2 if code == DTYPE_FLOAT8_E4M3FN else DTYPE_FLOAT8_E4M3FN
    assert fp8.from_wire(wire, 1, other, fp8.wire_shape(64), 64) is None
    # a bf16 payload of as many bytes (half the tokens) is not an fp8 block either
    assert bf16.from_wire(wire, 1, code, bf16.wire_shape(32), 32) is None


# ---- the data paths, against a real sidecar ------------------------------------------------
@pytest.fixture
def sidecar(local_dir: Path, tmp_path: Path) -> Iterator[Sidecar]:
    sc = Sidecar(
        SidecarSettings(
            port=0,
            memory_bytes=64 << 20,
            local_dir=local_dir,
            data_dir=tmp_path / "disk",
            disk_bytes=64 << 20,
        )
    ).start()
    try:
        yield sc
    finally:
        sc.stop()


def worker(port: int, local: Path | None, cache_dtype: str | None) -> WorkerSide:
    """A worker over vLLM-CPU-shaped caches: fp8 (`cache_dtype`) or bf16 (None)."""
    config = ConnectorConfig(
        sidecar_url=f"lm://127.0.0.1:{port}",
        local_dir=str(local) if local else None,
        chunk_size=64,
    )
    side = WorkerSide(config, N)
    if cache_dtype is None:
        write = vllm_write("auto", torch.bfloat16, (1.0, 1.0))
        caches = {
            f"l{i}": torch.randn(BLOCKS, HEADS, N, 2 * DIM).to(torch.bfloat16)
            for i in range(LAYERS)
        }
        side.register(caches, {k: (write, HEADS, DIM) for k in caches})
    else:
        dtype = FP8_CACHE_DTYPES[cache_dtype]
        probe = probe_writer(vllm_write(cache_dtype, torch.bfloat16, (1.0, 1.0)), torch.bfloat16)
        caches = cache_views({f"l{i}": fp8_cache() for i in range(LAYERS)}, dtype)
        side.register(caches, {k: (probe, HEADS, DIM) for k in caches})
    assert side.enabled
    return side


def pieces(tag: str, dtype: str) -> list[Piece]:
    return [
        Piece(f"m@1@0@{tag}{i:x}@{dtype}@s%sess", i, min(64, TOKENS - i))
        for i in range(0, TOKENS, 64)
    ]


def kv_bytes(side: WorkerSide, blocks: list[int]) -> torch.Tensor:
    kv = gather(side.caches, side.layouts, slots_of(blocks, N, N, 0, TOKENS))
    return kv.contiguous().view(torch.uint8)


def store(side: WorkerSide, ps: list[Piece]) -> None:
    side.save(StepPlan(stores=[StoreSpec("s", "sess", ps, SRC)]))
    side.take_sent()
    if side.sidecar is not None:
        side.sidecar.drain()


def load(side: WorkerSide, ps: list[Piece]) -> set[int]:
    side.load(StepPlan(loads=[LoadSpec("l", 0, TOKENS, ps, DST)]))
    return side.take_invalid()


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize(("stored", "loaded"), [("shm", "shm"), ("tcp", "tcp"), ("tcp", "shm")])
def test_fp8_blocks_move_byte_for_byte_on_every_path(
    sidecar: Sidecar, local_dir: Path, cache_dtype: str, stored: str, loaded: str
) -> None:
    a = worker(sidecar.port, local_dir if stored == "shm" else None, cache_dtype)
    b = worker(sidecar.port, local_dir if loaded == "shm" else None, cache_dtype)
    try:
        name = TORCH_TO_KEY_NAME[FP8_CACHE_DTYPES[cache_dtype]]
        ps = pieces("a", name)
        store(a, ps)
        assert load(b, ps) == set()
        assert torch.equal(kv_bytes(b, DST), kv_bytes(a, SRC))
        counts_a, counts_b = a.counters.drain(), b.counters.drain()
        per_token = 2 * LAYERS * HEADS * DIM  # one byte an element
        assert counts_a[f"store_bytes_{stored}"] >= per_token * (TOKENS // N * N)
        assert counts_b[f"load_bytes_{loaded}"] >= per_token * (TOKENS // N * N)
    finally:
        a.close()
        b.close()


def test_fp8_blocks_come_back_from_the_disk_tier_after_a_restart(tmp_path: Path) -> None:
    settings = SidecarSettings(
        port=0, memory_bytes=64 << 20, data_dir=tmp_path / "disk", disk_bytes=64 << 20
    )
    first = Sidecar(settings).start()
    a = worker(first.port, None, "fp8")
    ps = pieces("d", "fp8_e4m3fn")
    try:
        store(a, ps)
    finally:
        first.stop()  # a clean stop writes memory-only blocks to disk
    second = Sidecar(settings.model_copy(update={"port": first.port})).start()
    b = worker(second.port, None, "fp8")
    try:
        assert load(b, ps) == set()
        assert torch.equal(kv_bytes(b, DST), kv_bytes(a, SRC))
    finally:
        a.close()
        b.close()
        second.stop()


@pytest.mark.parametrize(("writer", "reader"), [("fp8", None), (None, "fp8"), ("fp8", "fp8_e5m2")])
@pytest.mark.parametrize("path", ["shm", "tcp"])
def test_a_block_of_another_kv_dtype_is_a_miss_even_under_the_same_key(
    sidecar: Sidecar, local_dir: Path, writer: str | None, reader: str | None, path: str
) -> None:
    """The second guard: keys already differ by dtype (`test_keys_...`); were a block of
    another dtype found under the key asked for, its payload's dtype refuses it."""
    local = local_dir if path == "shm" else None
    a, b = worker(sidecar.port, local, writer), worker(sidecar.port, local, reader)
    try:
        ps = pieces("x", "samekey")
        store(a, ps)
        before = kv_bytes(b, DST)
        assert load(b, ps) == set(DST)  # every block reported for recompute
        assert torch.equal(kv_bytes(b, DST), before)  # and nothing written
    finally:
        a.close()
        b.close()


# ---- the scheduler half: fp8 is served, and its keys name it --------------------------------
@pytest.fixture
def everything(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    from tests.vllm_connector import test_connector_refusal as refusal

    fake = refusal.EverythingSidecar()
    monkeypatch.setattr(refusal.connector_mod, "kv_client_factory", lambda *a: lambda: fake)
    monkeypatch.setattr(refusal.connector_mod, "_log_like_vllm", lambda: None)
    yield fake


@pytest.mark.parametrize(
    ("cache_dtype", "name"),
    [
        ("auto", "bfloat16"),
        ("fp8", "fp8_e4m3fn"),
        ("fp8_e4m3", "fp8_e4m3fn"),
        ("fp8_e5m2", "fp8_e5m2"),
    ],
)
def test_the_scheduler_serves_an_fp8_cache_under_keys_of_its_dtype(
    everything: object, cache_dtype: str, name: str
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVQuantMode

    from tests.vllm_connector import test_connector_refusal as refusal

    mode = KVQuantMode.NONE if cache_dtype == "auto" else KVQuantMode.FP8_PER_TENSOR
    connector = refusal.CtxcacheConnector(
        refusal.vllm_config(cache_dtype=cache_dtype),
        KVConnectorRole.SCHEDULER,
        refusal.kv_cache_config(refusal.full(kv_quant_mode=mode)),
    )
    try:
        assert connector.refused is None
        matched, plan, keep = refusal.turn(connector, "r1")
        assert matched and keep and plan.loads and plan.stores
        keys = [p.key for spec in [*plan.loads, *plan.stores] for p in spec.pieces]
        assert keys and all(key.split("@")[4] == name for key in keys)  # the model is bf16
    finally:
        connector.shutdown()
