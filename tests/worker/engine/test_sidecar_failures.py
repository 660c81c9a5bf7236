"""The sidecar down, killed mid-run, or answering garbage: requests succeed, outputs exact."""

from __future__ import annotations

import threading

import torch

from tests.worker.conftest import (
    EngineFactory,
    Pending,
    Sidecar,
    assert_matches_recompute,
    generate,
    greedy,
    random_ids,
)
from worker.engine.engine import Engine
from worker.engine.runner import ModelRunner
from worker.kv.hashing import KeyMaker
from worker.kv.l1 import L1Cache
from worker.kv.manager import KVManager
from worker.kv.sidecar import SidecarKV


def test_sidecar_killed_mid_run(
    make_engine: EngineFactory, runner: ModelRunner, sidecar: Sidecar
) -> None:
    engine = make_engine(sidecar)
    rng = torch.Generator().manual_seed(31)
    histories = [generate(engine, random_ids(rng, 70), tags=(("s", f"k{i}"),)) for i in range(3)]
    engine.kv.l1.clear()
    pending = [
        Pending(engine, h.prompt + h.tokens + random_ids(rng, 8), greedy(40), (("s", f"k{i}"),))
        for i, h in enumerate(histories)
    ]
    killer = threading.Timer(0.05, sidecar.kill)
    killer.start()
    results = [p.result() for p in pending]
    killer.join()
    engine.wait_idle()
    # and after it is gone: more turns, cold L1, all recomputed correctly
    engine.kv.l1.clear()
    later = [
        generate(engine, r.prompt + r.tokens + random_ids(rng, 5), tags=(("s", f"k{i}"),))
        for i, r in enumerate(results)
    ]
    for r in results + later:
        assert r.finish_reason == "length" and len(r.tokens) in (40, 6)
        assert_matches_recompute(runner, r)
    assert all(r.prefix.sidecar_tokens == 0 for r in later)


def test_sidecar_never_started(make_engine: EngineFactory, runner: ModelRunner, tmp_path) -> None:
    engine = make_engine(Sidecar(tmp_path))  # a URL nobody listens on
    result = generate(engine, random_ids(torch.Generator().manual_seed(1), 50))
    assert result.prefix.tokens == 0
    assert_matches_recompute(runner, result)


class GarbageClient:
    """Answers every GET with a block that is not what the worker stored."""

    def __init__(self, mode: str, real: SidecarKV | None = None) -> None:
        self.mode = mode

    def put(self, key: str, data: object, *, fmt: int, dtype: int, shape: tuple) -> None:
        pass

    def get(self, key: str) -> object:
        from sidecar.client import KVBlock

        L, T, HD = 4, 32, 64
        if self.mode == "shape":  # another model's layout (one layer more), consistent size
            return KVBlock(bytearray(2 * (L + 1) * 16 * HD * 4), 1, 4, (2, L + 1, 16, HD))
        if self.mode == "size":  # header says one thing, payload another
            return KVBlock(bytearray(100), 1, 4, (2, L, T, HD))
        return KVBlock(bytearray(2 * L * T * HD * 2), 1, 3, (2, L, T, HD))  # bfloat16

    def exists(self, key: str) -> bool:
        return True

    def health(self) -> bool:
        return True

    def close(self) -> None:
        pass


def test_garbage_blocks_are_misses(runner: ModelRunner) -> None:
    assert runner.kv_shape.num_layers == 4 and runner.kv_shape.num_kv_heads * 32 == 64
    for mode in ("shape", "size", "dtype"):
        side = SidecarKV(lambda m=mode: GarbageClient(m), runner.kv_shape)
        kv = KVManager(L1Cache(1 << 20), side, KeyMaker("tiny", "float", 0), 32)
        engine = Engine(runner, kv)
        engine.start()
        try:
            result = generate(engine, random_ids(torch.Generator().manual_seed(2), 90))
        finally:
            engine.stop()
        assert result.prefix.tokens == 0, mode
        assert_matches_recompute(runner, result)


def test_tags_too_long_for_lmcache_keys_skip_the_sidecar(
    make_engine: EngineFactory, runner: ModelRunner, sidecar: Sidecar
) -> None:
    engine = make_engine(sidecar)
    tags = (("s", "x" * 140),)
    ids = random_ids(torch.Generator().manual_seed(8), 80)
    generate(engine, ids, tags=tags)
    engine.kv.l1.clear()
    result = generate(engine, [*ids, 5], tags=tags)
    assert result.prefix.tokens == 0  # nothing was stored in, or read from, the sidecar
    assert_matches_recompute(runner, result)
