"""An MLA model's latent cache through the connector (vllm_connector/mla.py), without vLLM's
engine: real CPU MLA caches (`[blocks, 16, 576]`) written by vLLM's own `CPU_MLA` write op,
a real sidecar, both data paths.

What a user would notice: the latent stored by one request is loaded into another's blocks
exactly, over lm:// in LMCache's `KV_MLA_FMT` (`[1, L, T, 576]`, format 6) and through shared
memory; under tensor parallelism one copy is stored (rank 0's) and every rank loads it; an
MLA engine the connector cannot serve (a quantised or sparse latent) is refused in words.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from benchmarks.kvpath.kvpath_mla import vllm_cpu_mla_impl
from ctxcache.lmcache_keys import parse_key
from sidecar.protocol import FMT_KV_MLA
from sidecar.service import Sidecar
from sidecar.settings import SidecarSettings
from tests.utils import local_dir_fixture, require_vllm  # noqa: F401 (the local_dir fixture)
from vllm_connector import mla
from vllm_connector.config import ConnectorConfig
from vllm_connector.layout import LayoutError, gather, scatter, token_slots
from vllm_connector.plan import LoadSpec, Piece, StoreSpec
from vllm_connector.scheduler import StepPlan
from vllm_connector.worker import WorkerSide
from worker.kv.layout import KVShape

N, RANK, ROPE, LAYERS, BLOCKS = 16, 512, 64, 3, 40  # vLLM's CPU MLA: 16-token blocks, 576
LATENT = RANK + ROPE
TOKENS = 200  # 12 whole blocks and a partial one
SRC = list(range(0, 13))
DST = [30, 17, 25, 14, 39, 20, 33, 15, 22, 36, 18, 27, 31]  # a paged cache's random order


@pytest.fixture(scope="module")
def layer() -> Any:
    """An MLA layer as the connector sees it: vLLM's CPU MLA impl (its real cache write)."""
    require_vllm()
    impl = vllm_cpu_mla_impl(LATENT)
    assert impl is not None
    return SimpleNamespace(impl=impl, kv_lora_rank=RANK, kv_cache_dtype="auto", head_size=LATENT)


def caches(
    dtype: torch.dtype = torch.bfloat16, seed: int = 0, view: bool = True
) -> dict[str, torch.Tensor]:
    """`view`: as vLLM's CPU model runner registers them, `[blocks, 1, N, latent]`."""
    gen = torch.Generator().manual_seed(seed)
    shape = (BLOCKS, 1, N, LATENT) if view else (BLOCKS, N, LATENT)
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=gen).to(dtype)
        for i in range(LAYERS)
    }


@pytest.mark.parametrize(
    ("dtype", "view"), [(torch.bfloat16, True), (torch.float32, True), (torch.bfloat16, False)]
)
def test_the_latent_layout_is_learned_from_the_backends_own_write(
    layer: Any, dtype: torch.dtype, view: bool
) -> None:
    write = mla.latent_writer(layer)
    cs = list(caches(dtype, view=view).values())
    layout = mla.probe_latent_layout(cs[0], write, 1, LATENT)
    assert layout.planes == 1 and layout.tokens == N and layout.elems == N * LATENT
    layouts = [layout] * LAYERS
    gen = torch.Generator().manual_seed(1)
    latents = [torch.randn(TOKENS, LATENT, generator=gen).to(dtype) for _ in cs]
    src = token_slots([7, 2, 9, 4, 11, 0, 5, 8, 1, 3, 6, 10, 12], N, N, 0, TOKENS)
    for cache, lat in zip(cs, latents, strict=True):
        write(lat, cache, src.blocks * N + src.within)

    got = gather(cs, layouts, src)  # [1, L, 1, T, latent]
    assert got.shape == (1, LAYERS, 1, TOKENS, LATENT)
    assert torch.equal(got[0, :, 0], torch.stack(latents))

    ours, theirs = caches(dtype, seed=5, view=view), caches(dtype, seed=5, view=view)
    dst = token_slots(DST, N, N, 0, TOKENS)
    scatter(list(ours.values()), layouts, dst, got)
    for cache, lat in zip(theirs.values(), latents, strict=True):
        write(lat, cache, dst.blocks * N + dst.within)
    assert all(torch.equal(a, b) for a, b in zip(ours.values(), theirs.values(), strict=True))


def test_a_cache_that_is_not_one_latent_is_refused(layer: Any) -> None:
    with pytest.raises(LayoutError):
        mla.probe_latent_layout(torch.zeros(4, 2, N, 64), mla.latent_writer(layer), 1, 64)


def test_the_wire_payload_is_lmcaches_mla_format() -> None:
    shape = KVShape(LAYERS, 1, LATENT, torch.bfloat16, planes=1)
    assert shape.fmt == FMT_KV_MLA == 6
    assert shape.wire_shape(TOKENS) == (1, LAYERS, TOKENS, LATENT)
    assert shape.bytes_per_token() == LAYERS * LATENT * 2  # half of K and V of one 576 head
    kv = torch.randn(1, LAYERS, 1, TOKENS, LATENT).to(torch.bfloat16)
    wire = shape.to_wire(kv)
    flat = torch.frombuffer(bytearray(wire), dtype=torch.bfloat16).view(1, LAYERS, TOKENS, LATENT)
    assert torch.equal(flat[0], kv[0, :, 0])  # [L, T, latent]: one tensor per layer
    back = shape.from_wire(wire, FMT_KV_MLA, shape.dtype_code, shape.wire_shape(TOKENS), TOKENS)
    assert back is not None and torch.equal(back, kv)
    # a KV_2LTD block of the same bytes is not the latent
    assert shape.from_wire(wire, 1, shape.dtype_code, shape.wire_shape(TOKENS), TOKENS) is None


def test_keys_name_no_rank_and_carry_the_formats_version() -> None:
    keys = mla.key_maker("deepseek", "bfloat16")
    key = parse_key(keys.key(0xABC, (("s", "sess"),)))
    assert (key.world_size, key.worker_id) == (1, 0)
    assert key.tags == (("mla", str(mla.FORMAT_VERSION)), ("s", "sess"))
    assert key.session == "sess"


# ---- refusals -------------------------------------------------------------------------------
def _config(cache_dtype: str = "auto", model_type: str = "deepseek_v2", **hf: Any) -> Any:
    return SimpleNamespace(
        model_config=SimpleNamespace(
            use_mla=True, hf_config=SimpleNamespace(model_type=model_type, **hf)
        ),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
    )


def _groups(*specs: Any) -> Any:
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])


def test_what_of_an_mla_engine_is_served_and_what_is_refused() -> None:
    require_vllm()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    latent = MLAAttentionSpec(block_size=N, num_kv_heads=1, head_size=LATENT, dtype=torch.bfloat16)
    assert mla.unsupported(_config(), _groups(latent)) is None
    assert mla.unsupported(_config(), None) is None
    assert "fp8" in str(mla.unsupported(_config("fp8"), _groups(latent)))
    assert "sparse" in str(mla.unsupported(_config(model_type="deepseek_v32"), None))
    assert "sparse" in str(mla.unsupported(_config(index_topk=2048), None))
    assert "2 KV cache groups" in str(mla.unsupported(_config(), _groups(latent, latent)))
    full = FullAttentionSpec(block_size=N, num_kv_heads=1, head_size=LATENT, dtype=torch.bfloat16)
    assert "FullAttentionSpec" in str(mla.unsupported(_config(), _groups(full)))


# ---- both data paths, and tensor parallelism ---------------------------------------------------
@pytest.fixture
def sidecar(local_dir: Path) -> Iterator[Sidecar]:
    sc = Sidecar(SidecarSettings(port=0, memory_bytes=64 << 20, local_dir=local_dir)).start()
    try:
        yield sc
    finally:
        sc.stop()


def worker(sidecar: Sidecar, local: Path | None, layer: Any, rank: int = 0) -> WorkerSide:
    config = ConnectorConfig(
        sidecar_url=f"lm://127.0.0.1:{sidecar.port}",
        local_dir=str(local) if local else None,
        chunk_size=64,
    )
    side = WorkerSide(config, N, rank, latent=True)
    cs = caches(seed=rank)  # each rank's own cache tensors (another process's, in vLLM)
    side.register(cs, mla.writers({name: layer for name in cs}, list(cs)))
    assert side.enabled
    return side


def pieces(tag: str) -> list[Piece]:
    keys = mla.key_maker("m", "bfloat16")
    return [
        Piece(keys.key(int(tag, 16) * 1000 + i, (("s", "sess"),)), i, min(64, TOKENS - i))
        for i in range(0, TOKENS, 64)
    ]


def latent(side: WorkerSide, blocks: list[int]) -> torch.Tensor:
    return gather(side.caches, side.layouts, token_slots(blocks, N, N, 0, TOKENS))


def store(side: WorkerSide, ps: list[Piece]) -> None:
    side.save(StepPlan(stores=[StoreSpec("s", "sess", ps, SRC)]))
    assert side.take_sent() == {"s"}  # (a rank that does not store frees the blocks at once)
    if side.sidecar is not None:
        side.sidecar.drain()


def load(side: WorkerSide, ps: list[Piece]) -> set[int]:
    side.load(StepPlan(loads=[LoadSpec("l", 0, TOKENS, ps, DST)]))
    return side.take_invalid()


@pytest.mark.parametrize("path", ["tcp", "shm"])
def test_the_latent_is_stored_once_and_every_rank_loads_it(
    sidecar: Sidecar, local_dir: Path, layer: Any, path: str
) -> None:
    local = local_dir if path == "shm" else None
    ranks = [worker(sidecar, local, layer, rank) for rank in (0, 1)]
    try:
        ps = pieces("a" if path == "tcp" else "b")
        store(ranks[1], ps)
        assert sidecar.store.keys() == []  # rank 1 holds the same latent: it stores nothing
        assert ranks[1].counters.drain().get("stores_left_to_rank0") == 1
        store(ranks[0], ps)
        assert sorted(sidecar.store.keys()) == sorted(p.key for p in ps)
        held = sidecar.store.get(ps[0].key)
        assert held is not None
        meta, _ = held
        if path == "tcp":  # LMCache's MLA payload: one [L, T, latent] tensor per layer
            assert (meta.fmt, meta.shape) == (FMT_KV_MLA, (1, LAYERS, 64, LATENT))
        assert meta.length == LAYERS * 64 * LATENT * 2
        source = latent(ranks[0], SRC)
        for side in ranks:
            assert load(side, ps) == set()
            assert torch.equal(latent(side, DST), source)
        counters = ranks[1].counters.drain()
        assert counters.get(f"load_bytes_{path}", 0) > 0
    finally:
        for side in ranks:
            side.close()
