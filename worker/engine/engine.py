"""The engine thread: admit requests, prefill each after its cached prefix, decode in batches.

One thread owns the model. Each turn of its loop admits waiting requests (up to
`max_batch` active sequences) — lookup, prefill, first token — then runs one decode step for
every active sequence together. A finished sequence's events go out first; then its KV is
cut out of the batch and stored (L1 here, the sidecar in the background), so storing
never delays the answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import torch
from transformers import DynamicCache

from ctxcache.errors import BackendUnavailable
from ctxcache.logs import bind_session
from worker.engine.batch import DecodeBatch
from worker.engine.request import Event, Request, Sequence
from worker.engine.runner import ModelRunner, cache_from_kv, kv_of_row
from worker.engine.sampler import make_generator, sample
from worker.kv.manager import CachedPrefix, KVManager
from worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        kv: KVManager,
        *,
        max_queue: int = 64,
        max_batch: int = 8,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.runner, self.kv = runner, kv
        self.max_queue, self.max_batch = max_queue, max_batch
        self.metrics = metrics
        self.waiting: deque[Request] = deque()
        self.active: list[Sequence] = []  # parallel to the batch's rows
        self.batch = DecodeBatch()
        self.peak_batch = 0  # the largest decode batch seen (tests, metrics)
        self._wake = threading.Condition()
        self._running = False
        self._busy = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    # -- called from other threads ------------------------------------------------------
    def start(self) -> None:
        self._running = True
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._running = False
            self._wake.notify()
        self._thread.join(timeout=30)
        if self.kv.sidecar is not None:
            self.kv.sidecar.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: Request) -> None:
        """Queue a request; BackendUnavailable at once when the queue is full."""
        with self._wake:
            if len(self.waiting) >= self.max_queue:
                raise BackendUnavailable(
                    f"the worker's request queue is full ({self.max_queue} waiting)"
                )
            self.waiting.append(request)
            self._wake.notify()

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Block until nothing is queued, running or being stored (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while (self.waiting or self.active or self._busy) and time.monotonic() < deadline:
            time.sleep(0.002)
        if self.kv.sidecar is not None:
            self.kv.sidecar.drain(max(0.0, deadline - time.monotonic()))

    # -- the engine thread --------------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._wake:
                while self._running and not self.waiting and not self.active:
                    self._busy = False
                    self._wake.wait()
                if not self._running:
                    return
                self._busy = True
                admit: list[Request] = []
                while self.waiting and len(self.active) + len(admit) < self.max_batch:
                    admit.append(self.waiting.popleft())
            for request in admit:
                try:
                    self._admit(request)
                except Exception:
                    log.exception("prefill failed; failing the request")
                    request.emit(Event(0, [], "", finish_reason="error"))
            if self.active:
                try:
                    self._step()
                except Exception:
                    log.exception("decode step failed; failing the batch")
                    for seq in self.active:
                        seq.request.emit(Event(seq.index, [], "", finish_reason="error"))
                    self.active, self.batch = [], DecodeBatch()

    def _admit(self, request: Request) -> None:
        if request.cancelled.is_set():
            return
        with bind_session(request.session):
            ids, params = request.prompt_ids, request.params
            prefix = self.kv.lookup(ids, request.tags, request.cache_root)
            logits, cache = self.runner.prefill(ids, prefix.kv)
            request.cached_tokens = prefix.tokens
            request.first_token_time = time.monotonic()
            request.prefix = prefix
            if self.metrics:
                self.metrics.prefilled(request, prefix)
            log.debug(
                "prefilled %d tokens after %d cached (%d L1, %d sidecar)",
                len(ids) - prefix.tokens,
                prefix.tokens,
                prefix.l1_tokens,
                prefix.sidecar_tokens,
            )
            if params.max_tokens == 0:
                for index in range(params.n):
                    request.emit(Event(index, [], "", finish_reason="length"))
                self._store(request, ids, kv_of_row(cache, 0, 0))
                return
            for index in range(params.n):
                seq = Sequence(request, index, make_generator(params, index), kv_tokens=len(ids))
                own = cache if index == params.n - 1 else _copy(cache)
                self._accept(seq, logits, sample(logits, params, seq.generator))
                if seq.finished:
                    self._finish(seq, kv_of_row(own, 0, 0, seq.kv_tokens))
                else:
                    self.batch.add(own)
                    self.active.append(seq)

    def _step(self) -> None:
        for row in [i for i, s in enumerate(self.active) if s.request.cancelled.is_set()]:
            self.active[row].finished = "abort"
        self._retire()
        if not self.active:
            return
        seqs = self.active
        self.peak_batch = max(self.peak_batch, len(seqs))
        assert self.batch.cache is not None
        logits = self.runner.decode(
            self.batch.cache,
            [s.output_ids[-1] for s in seqs],
            [s.kv_tokens for s in seqs],
            self.batch.attention_mask(),
        )
        if self.metrics:
            self.metrics.decoded(len(seqs))
        for i, seq in enumerate(seqs):
            seq.kv_tokens += 1
            self._accept(seq, logits[i], sample(logits[i], seq.request.params, seq.generator))
        self._retire()

    def _accept(self, seq: Sequence, logits: torch.Tensor, token: int) -> None:
        """Append `token` to `seq`, decide whether it stops, emit the new text."""
        params = seq.request.params
        seq.output_ids.append(token)
        finish: str | None = None
        if token in params.stop_token_ids or (
            token in self.runner.eos_ids and not params.ignore_eos
        ):
            finish = "stop"
        tokenizer = self.runner.tokenizer
        text = tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        for stop in params.stop:
            at = text.find(stop, max(0, len(seq.text) - len(stop)))
            if at != -1:
                text, finish = text[:at], "stop"
        if finish is None and len(seq.output_ids) >= params.max_tokens:
            finish = "length"
        if finish is None:
            # hold back an unfinished UTF-8 character and anything a stop string may start
            hold = max((len(s) - 1 for s in params.stop), default=0)
            text = text[: len(text) - hold] if hold else text
            if text.endswith("\ufffd"):
                text = text[:-1]
        delta = text[len(seq.text) :] if text.startswith(seq.text) else ""
        seq.text += delta
        seq.finished = finish
        captured = logits if seq.request.capture_logits else None
        seq.request.emit(Event(seq.index, [token], delta, finish, captured))

    def _retire(self) -> None:
        rows = [i for i, s in enumerate(self.active) if s.finished]
        if not rows:
            return
        done = [(self.active[i], self.batch.kv(i, self.active[i].kv_tokens)) for i in rows]
        self.batch.remove(rows)
        self.active = [s for s in self.active if not s.finished]
        for seq, kv in done:
            self._finish(seq, kv)

    def _finish(self, seq: Sequence, kv: torch.Tensor) -> None:
        if seq.finished != "abort":
            self._store(seq.request, seq.all_ids, kv)

    def _store(self, request: Request, ids: list[int], kv: torch.Tensor) -> None:
        prefix = request.prefix if isinstance(request.prefix, CachedPrefix) else CachedPrefix(None)
        with bind_session(request.session):
            self.kv.store(ids, kv, request.tags, prefix, request.session, request.cache_root)


def _copy(cache: DynamicCache) -> DynamicCache:
    return cache_from_kv(kv_of_row(cache, 0, 0))
