"""vLLM's paged KV cache on one worker, as the connector's copies address it (`PagedKV`):
its layers and their block layouts, the copier over them, this worker's tensor-parallel
rank (which names its shard's keys), and the arithmetic from a request's tokens to the
blocks that hold them. Both KV paths (`vllm_connector.shm_path`, `tcp_path`) write and
read it through one `PagedKV`, built once the cache is registered.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from ctxcache.lmcache_keys import parse_key
from vllm_connector.blockcopy import BlockCopier, kernel_blocks
from vllm_connector.layout import BlockLayout, token_slots
from vllm_connector.plan import LoadSpec, Piece
from worker.kv.layout import KVShape

# the connector's worker half logs as one (operators' settings name this logger)
log = logging.getLogger("vllm_connector.worker")


def rank_key(key: str, rank: int) -> str:
    """The scheduler's (rank 0) key for tensor-parallel rank `rank`."""
    if rank == 0:
        return key
    return replace(parse_key(key), worker_id=rank).to_string()


def blocks_of(block_ids: list[int], block_size: int, start: int, end: int) -> set[int]:
    """The (scheduler) blocks of `block_ids` that hold tokens `[start, end)`."""
    first, last = start // block_size, (end - 1) // block_size
    return set(block_ids[first : last + 1])


class PagedKV:
    def __init__(
        self,
        caches: list[torch.Tensor],
        layouts: list[BlockLayout],
        copier: BlockCopier,
        block_size: int,
        rank: int = 0,
    ) -> None:
        first = layouts[0]
        self.caches = caches
        self.layouts = layouts
        self.copier = copier
        self.block_size = block_size  # the scheduler's block, in tokens
        self.rank = rank
        self.shape = KVShape(
            len(caches), first.heads, first.head_dim, caches[0].dtype, first.planes
        )

    def key(self, key: str) -> str:
        """The scheduler's (rank 0) key for this worker's tensor-parallel rank."""
        return rank_key(key, self.rank)

    def kernel_blocks(self, block_ids: list[int], begin: int, end: int) -> list[int]:
        """The kernel blocks holding tokens `[begin, end)` of a request's `block_ids`."""
        return kernel_blocks(block_ids, self.block_size, self.layouts[0].tokens, begin, end)

    def quiesce(self, req_id: str) -> bool:
        """Wait until no copy issued so far runs (the copier's and, on CUDA, the calling
        thread's stream); False if that cannot be known (a broken CUDA context)."""
        try:
            self.copier.wait()
            if self.copier.device.type == "cuda":
                torch.cuda.current_stream(self.copier.device).synchronize()
        except Exception:
            log.exception("request %s: cannot wait for its copies", req_id)
            return False
        return True

    def write_2ltd(self, spec: LoadSpec, piece: Piece, kv: torch.Tensor, lo: int, hi: int) -> None:
        """Tokens [lo, hi) of `piece` from its KV_2LTD payload `kv` (`[2, L, H, T, D]`):
        whole blocks as the engine lays them out, then row copies (`write_2ltd`); the
        indexed scatter where that does not apply (a piece that ends inside a block, CUDA)."""
        n = self.copier.tokens
        if piece.begin % n == 0 and piece.length % n == 0:
            ids = self.kernel_blocks(spec.block_ids, piece.begin, hi)
            ids += [-1] * (piece.length // n - len(ids))  # past `hi`: never touched
            if self.copier.write_2ltd(ids, kv, lo - piece.begin, hi - piece.begin):
                return
        slots = token_slots(spec.block_ids, self.block_size, self.layouts[0].tokens, lo, hi)
        self.copier.scatter_2ltd(slots, kv[:, :, :, lo - piece.begin : hi - piece.begin])
