"""The worker half of one recurrent-state group (`StateSide`): a hybrid model's Mamba /
linear-attention layers, whose cache holds one state per block, not per-token K and V
(`vllm_connector.state_plan`; docs/vllm.md, "Hybrid models: recurrent state").

A state block is every layer's state tensors at one block id (vLLM's `MambaSpec`: for a
gated delta net, its conv state and its recurrent state; the tensors are the layers'
`kv_cache`, `[num_blocks, ...]` views of vLLM's pages). Its payload is those tensors'
bytes, layer by layer, one after the other, under LMCache's `BINARY` format with shape
`(STATE_VERSION, layers, tensors, bytes)`: a block of another shape is a miss, and the
key's tag (`Group.state`: a digest of the layout) keeps any other layout out.

A state block is small beside a history's KV (tens of KB to a few MB, once per session
turn), so it goes over `lm://` only, GETs and PUTs on one background thread, its own
connection; it takes no shared-memory lease. A store copies the block out on vLLM's
model-runner thread after the forward pass (so vLLM may free it at once) and PUTs it in
the background; a load GETs and writes it in the background, and its request is reported
once written (vLLM's loads of a hybrid model are asynchronous). Failures are misses: a
load that fails fails its request's load (the group worker reports it, vLLM recomputes);
a store that fails is dropped. Neither raises into vLLM's step.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from sidecar.protocol import DTYPE_UINT8, FMT_BINARY
from vllm_connector.config import ConnectorConfig
from vllm_connector.groups import STATE_VERSION
from vllm_connector.paged import rank_key
from vllm_connector.scheduler import StepPlan
from vllm_connector.stats import Counters
from worker.kv.sidecar import BlockClient, CircuitBreaker, kv_client_factory

# the connector's worker half logs as one (operators' settings name this logger)
log = logging.getLogger("vllm_connector.worker")


def state_tensors(layer: Any) -> list[torch.Tensor]:
    """A Mamba / linear-attention layer's state tensors, `[num_blocks, ...]` each."""
    cache = layer.kv_cache
    if cache and isinstance(cache[0], list | tuple):  # (one list per virtual engine)
        cache = cache[0]
    tensors = list(cache)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"{type(layer).__name__}.kv_cache holds no state tensors")
    return tensors


class StateSide:
    def __init__(
        self, config: ConnectorConfig, rank: int = 0, counters: Counters | None = None
    ) -> None:
        self.config = config
        self.rank = rank  # the rank its keys name: each rank holds its shard of every state
        self.counters = counters if counters is not None else Counters()
        self.tensors: list[torch.Tensor] = []  # every layer's state tensors, in order
        self.layers = 0
        self.off: str | None = None
        self.breaker = CircuitBreaker()
        self._make_client = kv_client_factory(config.sidecar_url, config.timeout_s)
        self._client: BlockClient | None = None  # (the io thread's only)
        self._io: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._loaded: dict[str, bool] = {}  # request -> whether its load failed
        self._sent: set[str] = set()

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The payload's wire shape (module docstring)."""
        return (STATE_VERSION, self.layers, len(self.tensors), self.block_bytes)

    @property
    def block_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors)

    def turn_off(self, reason: str) -> None:
        self.off = reason
        log.error("ctxcache connector off on this worker: %s; KV is recomputed", reason)

    def register(self, layers: dict[str, list[torch.Tensor]]) -> None:
        """The state tensors of the group's layers (`state_tensors`)."""
        tensors = [t for name in layers for t in layers[name]]
        if not tensors or len({t.shape[0] for t in tensors}) != 1:
            self.turn_off("its recurrent-state layers have no common block count")
            return
        self.tensors, self.layers = tensors, len(layers)
        log.info(
            "ctxcache connector: recurrent state of %d layers (%d tensors: %s), %d bytes per "
            "state block, over lm://",
            self.layers,
            len(tensors),
            ", ".join(f"{tuple(t.shape[1:])} {t.dtype}" for t in tensors),
            self.block_bytes,
        )

    # -- the bytes of one block -----------------------------------------------------------
    def read(self, block: int) -> torch.Tensor:
        """Block `block` of every state tensor, as one flat `uint8` host tensor."""
        parts = [t[block].contiguous().view(torch.uint8).reshape(-1) for t in self.tensors]
        return torch.cat(parts).cpu()

    def write(self, block: int, data: torch.Tensor) -> None:
        """The inverse of `read`."""
        at = 0
        for t in self.tensors:
            row = t[block]
            n = row.numel() * t.element_size()
            # (a copy: a slice's offset need not suit the next tensor's element size)
            src = data[at : at + n].to(t.device, copy=True).view(t.dtype).view(row.shape)
            row.copy_(src)
            at += n
        if self.tensors and self.tensors[0].is_cuda:
            torch.cuda.current_stream(self.tensors[0].device).synchronize()

    # -- the io thread --------------------------------------------------------------------
    def _submit(self, fn: Any, *args: Any) -> bool:
        try:
            if self._io is None:
                self._io = ThreadPoolExecutor(1, thread_name_prefix="ctxcache-state")
            self._io.submit(fn, *args)
        except RuntimeError:  # (shut down: the engine is closing)
            return False
        return True

    def _sidecar(self) -> BlockClient | None:
        if not self.breaker.closed:
            return None
        if self._client is None:
            self._client = self._make_client()
        return self._client

    def _failed(self, op: str, exc: Exception) -> None:
        backoff = self.breaker.failure()
        self.counters.add("sidecar_errors")
        if self._client is not None:
            self._client.close()
            self._client = None
        log.warning("sidecar state %s failed (%s); skipping it for %.0f s", op, exc, backoff)

    # -- loads ----------------------------------------------------------------------------
    def load(self, plan: StepPlan) -> None:
        for spec in plan.loads:
            can = self.off is None and spec.pieces and spec.block_ids
            key, block = (spec.pieces[0].key, spec.block_ids[0]) if can else ("", 0)
            if not can or not self._submit(self.load_one, spec.req_id, key, block):
                self._over(spec.req_id, failed=True)

    def load_one(self, rid: str, key: str, block: int) -> None:
        """(On the io thread; a benchmark calls it directly.) GET the state and write it
        into `block`, then report `rid`; never raises."""
        ok = False
        try:
            client = self._sidecar()
            got = client.get(rank_key(key, self.rank)) if client is not None else None
            if client is not None:
                self.breaker.success()
            if got is None:
                log.warning("request %s: state block %s gone; recomputing", rid, key)
            elif (got.fmt, got.dtype, tuple(got.shape)) != (FMT_BINARY, DTYPE_UINT8, self.shape):
                log.warning("request %s: block %s is not the state we store", rid, key)
            elif len(got.data) != self.block_bytes:
                log.warning("request %s: state block %s is cut short", rid, key)
            else:
                buf = got.data if isinstance(got.data, bytearray) else bytearray(got.data)
                self.write(block, torch.frombuffer(buf, dtype=torch.uint8))
                self.counters.add("state_load_bytes", self.block_bytes)
                ok = True
        except Exception as exc:
            self._failed("get", exc)
        if not ok:
            self.counters.add("load_failures")
        self._over(rid, failed=not ok)

    def _over(self, rid: str, *, failed: bool) -> None:
        with self._lock:
            self._loaded[rid] = failed

    def take_loaded_blocks(self) -> dict[str, bool]:
        """Requests whose state load is over since the last call: whether it failed."""
        with self._lock:
            out, self._loaded = self._loaded, {}
        return out

    def take_invalid(self) -> set[int]:
        return set()  # (a failed load fails its request: `GroupWorker.take_failed`)

    # -- stores ---------------------------------------------------------------------------
    def save(self, plan: StepPlan) -> None:
        """Copy each finished request's state block out now (after the forward pass, on
        vLLM's model-runner thread), PUT it in the background. Never raises."""
        for spec in plan.stores:
            self._sent.add(spec.req_id)  # the copy is made here (or given up): free it
            if self.off is not None or not self.breaker.closed:
                self.counters.add("store_drops")
                continue
            try:
                data = self.read(spec.block_ids[0])
            except Exception as exc:
                self.counters.add("store_errors")
                log.warning("request %s: reading its state failed (%s)", spec.req_id, exc)
                continue
            key = rank_key(spec.pieces[0].key, self.rank)
            if not self._submit(self.put_one, spec.session, key, data):
                self.counters.add("store_drops")

    def put_one(self, session: str, key: str, data: torch.Tensor) -> None:
        """(On the io thread; a benchmark calls it directly.) PUT one state block (`read`'s
        bytes); never raises."""
        try:
            client = self._sidecar()
            if client is None:
                self.counters.add("store_drops")
                return
            client.put(
                key, memoryview(data.numpy()), fmt=FMT_BINARY, dtype=DTYPE_UINT8, shape=self.shape
            )
            self.breaker.success()
            self.counters.add("state_store_bytes", int(data.numel()))
            log.debug("stored a state block", extra={"session_id": session})
        except Exception as exc:
            self.counters.add("store_drops")
            self._failed("put", exc)

    def round_trip(self) -> None:
        """One round trip on the io connection: PUT has no reply, so after it the sidecar
        holds every PUT sent before (benchmarks, tests)."""
        client = self._sidecar()
        if client is not None:
            client.health()

    def take_sent(self) -> set[str]:
        out, self._sent = self._sent, set()
        return out

    def close(self) -> None:
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        if self._client is not None:
            self._client.close()
            self._client = None
