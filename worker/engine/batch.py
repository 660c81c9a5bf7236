"""The decode batch: every active sequence's KV in one left-padded DynamicCache.

Row i holds sequence i's KV right-aligned: columns `[pad[i]:]` are its tokens, columns
before are zeros that the attention mask hides. A sequence joins after its own prefill
(the batch is re-padded to the longest), and leaves with exactly its own columns of its
own row — never padding, never another request's rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from worker.engine.runner import kv_of_row


class DecodeBatch:
    def __init__(self) -> None:
        self.cache: DynamicCache | None = None
        self.pads: list[int] = []

    def __len__(self) -> int:
        return len(self.pads)

    @property
    def width(self) -> int:
        if self.cache is None:
            return 0
        return int(self.cache.layers[0].keys.shape[2])

    def add(self, cache: DynamicCache) -> int:
        """Append a batch-1 cache as a new row; returns its row index."""
        length = int(cache.layers[0].keys.shape[2])
        if self.cache is None:
            self.cache, self.pads = cache, [0]
            return 0
        width = max(self.width, length)
        grow, pad_new = width - self.width, width - length
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat(
                [F.pad(mine.keys, (0, 0, grow, 0)), F.pad(theirs.keys, (0, 0, pad_new, 0))]
            )
            mine.values = torch.cat(
                [F.pad(mine.values, (0, 0, grow, 0)), F.pad(theirs.values, (0, 0, pad_new, 0))]
            )
        self.pads = [p + grow for p in self.pads] + [pad_new]
        return len(self.pads) - 1

    def attention_mask(self) -> torch.Tensor | None:
        """`[B, width + 1]`: 0 over each row's padding, 1 over its tokens and the new one."""
        if not any(self.pads):
            return None
        cols = torch.arange(self.width + 1)[None, :]
        return (cols >= torch.tensor(self.pads)[:, None]).long()

    def kv(self, row: int, tokens: int) -> torch.Tensor:
        """The first `tokens` KV columns of row `row`'s own sequence, `[2, L, H, T, D]`."""
        assert self.cache is not None
        start = self.pads[row]
        return kv_of_row(self.cache, row, start, start + tokens)

    def remove(self, rows: list[int]) -> None:
        """Drop finished rows, then the padding columns no remaining row needs."""
        assert self.cache is not None
        keep = [i for i in range(len(self.pads)) if i not in set(rows)]
        if not keep:
            self.cache, self.pads = None, []
            return
        index = torch.tensor(keep)
        trim = min(self.pads[i] for i in keep)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, trim:]
            layer.values = layer.values.index_select(0, index)[:, :, trim:]
        self.pads = [self.pads[i] - trim for i in keep]
