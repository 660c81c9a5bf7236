"""The in-process floor of `ctxcache bench multiturn --engine builtin`: the same model in
this process, each conversation's KV kept in memory, only the new tokens prefilled — what a
session turn on the built-in worker cannot beat."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


class Floor:
    """The model in this process, each conversation's KV kept in memory: a turn prefills
    only the tokens that are new since the KV was computed."""

    def __init__(self, model: Path, threads: int) -> None:
        from worker.engine.runner import ModelRunner

        self.runner = ModelRunner(str(model), threads=threads)
        self.tokenizer = self.runner.tokenizer
        self.runner.prefill(list(range(1, 65)), None)  # warm up: the first call is slow
        self.kv: dict[int, tuple[list[int], Any]] = {}  # conversation -> (ids, KV of ids)

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(t) for t in ids]

    def turn(
        self, conv: int, messages: list[dict[str, str]], answer: str
    ) -> tuple[float, int, int]:
        """TTFT of this turn (prefill of the new tokens + the first greedy token), the
        number of tokens prefilled, the prompt's length. Then, untimed, the answer's KV is
        added, as decoding it would have."""
        import torch

        from worker.engine.runner import kv_of_row

        ids = self.render(messages)
        known, kv = self.kv.get(conv, ([], None))
        common = 0
        for a, b in zip(known, ids[:-1], strict=False):
            if a != b:
                break
            common += 1
        prefix = kv[:, :, :, :common] if kv is not None and common else None
        # One prefill, as an engine makes one per turn. (Repeating it and keeping the
        # median flatters the floor: the second run of the same prefill finds caches warm,
        # 20-30% faster here.)
        t0 = time.perf_counter()
        logits, cache = self.runner.prefill(ids, prefix)
        int(torch.argmax(logits))
        ttft = time.perf_counter() - t0
        answer_ids = self.tokenizer.encode(answer, add_special_tokens=False)
        full = ids + answer_ids
        if answer_ids:
            _, cache = self.runner.prefill(full, kv_of_row(cache, 0, 0))
        self.kv[conv] = (full, kv_of_row(cache, 0, 0))
        return ttft, len(ids) - common, len(ids)
