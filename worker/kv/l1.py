"""The in-process L1: hot KV blocks of 16 tokens, LRU under a byte budget.

It plays vLLM's GPU prefix cache: blocks are keyed by the prefix-chained block hash only
(not by session tags), so two requests with the same prefix share blocks, as in vLLM.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch


class L1Cache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.bytes = 0
        self._blocks: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def get_prefix(self, hashes: list[int]) -> list[torch.Tensor]:
        """The blocks of the longest prefix of `hashes` that is cached (marked recently used)."""
        found: list[torch.Tensor] = []
        with self._lock:
            for h in hashes:
                block = self._blocks.get(h)
                if block is None:
                    break
                self._blocks.move_to_end(h)
                found.append(block)
        return found

    def get(self, block_hash: int) -> torch.Tensor | None:
        with self._lock:
            block = self._blocks.get(block_hash)
            if block is not None:
                self._blocks.move_to_end(block_hash)
            return block

    def put(self, block_hash: int, block: torch.Tensor) -> None:
        size = block.nbytes
        if size > self.budget:
            return
        with self._lock:
            if block_hash in self._blocks:
                self._blocks.move_to_end(block_hash)
                return
            self._blocks[block_hash] = block
            self.bytes += size
            while self.bytes > self.budget:
                _, old = self._blocks.popitem(last=False)
                self.bytes -= old.nbytes

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.bytes = 0
