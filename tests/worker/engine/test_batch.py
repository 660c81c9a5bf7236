"""The decode batch: each request's KV is its own rows and columns, nothing else."""

from __future__ import annotations

import torch

from sidecar.client import KVClient
from tests.worker.conftest import EngineFactory, Pending, Sidecar, greedy, random_ids
from worker.engine.batch import DecodeBatch
from worker.engine.runner import ModelRunner, cache_from_kv
from worker.kv.hashing import chunk_hashes


def _kv(tokens: int, fill: float) -> torch.Tensor:
    return torch.full((2, 3, 2, tokens, 4), fill) + torch.arange(tokens).view(1, 1, 1, -1, 1)


def test_rows_keep_their_own_kv_through_joins_and_leaves() -> None:
    batch = DecodeBatch()
    lengths = {0: 5, 1: 9, 2: 3}
    for i, n in lengths.items():
        batch.add(cache_from_kv(_kv(n, 100.0 * i)))
    assert batch.pads == [4, 0, 6]
    for i, n in lengths.items():
        assert torch.equal(batch.kv(i, n), _kv(n, 100.0 * i))
    mask = batch.attention_mask()
    assert mask is not None and mask.tolist()[2] == [0] * 6 + [1] * 4
    batch.remove([1])  # the longest leaves: the padding nobody needs goes too
    assert batch.pads == [0, 2] and batch.width == 5
    assert torch.equal(batch.kv(0, 5), _kv(5, 0.0))
    assert torch.equal(batch.kv(1, 3), _kv(3, 200.0))


def test_stored_kv_of_each_request_in_a_batch(
    make_engine: EngineFactory, runner: ModelRunner, sidecar: Sidecar
) -> None:
    """Four requests decoded together: each one's sidecar chunks hold exactly its own KV."""
    engine = make_engine(sidecar, tail_blocks=False)
    rng = torch.Generator().manual_seed(21)
    prompts = [random_ids(rng, n) for n in (40, 75, 20, 58)]
    pending = [Pending(engine, p, greedy(30), (("s", f"r{i}"),)) for i, p in enumerate(prompts)]
    results = [p.result() for p in pending]
    engine.wait_idle()
    assert engine.peak_batch == 4
    shape = runner.kv_shape
    client = KVClient.from_url(sidecar.lm_url)
    try:
        for i, r in enumerate(results):
            ids = r.prompt + r.tokens
            kv_len = len(ids) - 1
            out = runner.model(torch.tensor([ids[:kv_len]]), use_cache=True).past_key_values
            ref = torch.stack(
                [
                    torch.stack([layer.keys[0] for layer in out.layers]),
                    torch.stack([layer.values[0] for layer in out.layers]),
                ]
            )
            hashes = chunk_hashes(ids, 32, kv_len)
            assert len(hashes) == kv_len // 32
            for c, h in enumerate(hashes):
                block = client.get(engine.kv.keys.key(h, (("s", f"r{i}"),)))
                assert block is not None
                assert tuple(block.shape) == (
                    2,
                    shape.num_layers,
                    32,
                    shape.num_kv_heads * shape.head_dim,
                )
                got = shape.from_wire(block.data, block.fmt, block.dtype, block.shape, 32)
                assert got is not None
                want = ref[:, :, :, c * 32 : (c + 1) * 32]
                assert (got - want).abs().max().item() < 1e-4
    finally:
        client.close()
