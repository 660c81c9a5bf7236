from __future__ import annotations

import torch

from worker.kv.l1 import L1Cache


def test_prefix_lookup_and_lru_eviction_under_budget() -> None:
    block = torch.zeros(2, 1, 1, 16, 4)  # 512 bytes
    l1 = L1Cache(budget_bytes=3 * block.nbytes)
    for h in (1, 2, 3):
        l1.put(h, block.clone())
    assert len(l1.get_prefix([1, 2, 3, 4])) == 3
    assert len(l1.get_prefix([2, 9, 3])) == 1  # stops at the first miss; 2 is used
    l1.get_prefix([1])  # recency now, oldest first: 3, 2, 1
    l1.put(4, block.clone())  # evicts the least recently used: 3
    assert 3 not in l1 and all(h in l1 for h in (1, 2, 4))
    assert l1.bytes == 3 * block.nbytes
    l1.put(5, torch.zeros(2, 1, 1, 16, 400))  # larger than the whole budget: not kept
    assert 5 not in l1
