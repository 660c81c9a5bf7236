"""`CtxcacheConnector`: vLLM's KV connector API over the ctxcache sidecar.

Load it with
`--kv-transfer-config '{"kv_connector": "CtxcacheConnector",
"kv_connector_module_path": "vllm_connector.connector", "kv_role": "kv_both",
"kv_connector_extra_config": {"sidecar_url": "lm://127.0.0.1:65432"}}'`
(`ctxcache serve --engine vllm` does). vLLM builds one instance in the scheduler process
(`SchedulerSide`: lookups and plans) and one in each worker process (`WorkerSide`: the
copies); this class only routes vLLM's hooks to them (docs/vllm.md).

What it cannot serve (`unsupported`: MLA, a quantised KV cache other than per-tensor fp8,
hybrid models) it refuses
at start-up on both sides with one log line, and vLLM runs without it: no lookups, loads or
stores (`"required": true` makes that a start-up error instead). A worker that turns
itself off later (its cache layout cannot be read) says so in its step output
(`CtxcacheWorkerMeta`), and the scheduler half then plans nothing more.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheSpec,
    KVQuantMode,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
)

from ctxcache import tracing
from vllm_connector import kvdtype
from vllm_connector.config import ConnectorConfig
from vllm_connector.metrics import CtxcachePromMetrics, CtxcacheStats
from vllm_connector.plan import Planner
from vllm_connector.scheduler import SchedulerSide, StepPlan
from vllm_connector.worker import WorkerSide, cache_writer
from worker.kv.hashing import KeyMaker
from worker.kv.layout import TORCH_TO_KEY_NAME
from worker.kv.sidecar import kv_client_factory

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class CtxcacheMetadata(StepPlan, KVConnectorMetadata):
    """One step's loads and stores, scheduler -> workers."""


@dataclass
class CtxcacheWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler, each step: why a worker carries out no load (None: it does)."""

    off: str | None = field(default=None)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if self.off is None and isinstance(other, CtxcacheWorkerMeta):
            self.off = other.off
        return self


INSTEAD = (
    "for this model use LMCache's connector (LMCacheConnectorV1) or run vLLM without "
    "--kv-transfer-config"
)


class CtxcacheConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_like_vllm()
        _trace_like_vllm(vllm_config)
        transfer = self._kv_transfer_config
        self.config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config)
        block_size = vllm_config.cache_config.block_size
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        # what this connector cannot serve: refused, on both sides alike (the same config)
        self.refused = unsupported(vllm_config, kv_cache_config)
        if self.refused is not None:
            if self.config.required:
                raise ValueError(
                    f"the ctxcache connector does not support {self.refused}; {INSTEAD}"
                )
            log.error(
                "ctxcache connector (%s): %s is not supported; vLLM runs without it, "
                'nothing is looked up, loaded or stored (%s; "required": true in '
                "kv_connector_extra_config makes this a start-up error)",
                role.name.lower(),
                self.refused,
                INSTEAD,
            )
            return
        if role == KVConnectorRole.SCHEDULER:
            # A cache: a block that cannot be loaded is recomputed, never a failed request.
            if transfer.kv_load_failure_policy != "recompute":
                log.info("ctxcache connector: kv_load_failure_policy set to 'recompute'")
                transfer.kv_load_failure_policy = "recompute"
            planner = Planner(
                _key_maker(vllm_config, self.config),
                self.config.chunk_size,
                self.config.tail_granularity(block_size),
            )
            self.scheduler = SchedulerSide(
                self.config,
                planner,
                kv_client_factory(self.config.sidecar_url, self.config.lookup_timeout_s),
            )
        else:
            from vllm.distributed import get_tensor_model_parallel_rank

            self.worker = WorkerSide(self.config, block_size, get_tensor_model_parallel_rank())

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped store is a later miss, nothing more

    # -- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.worker is None:
            return  # refused at start-up
        layers = self._vllm_config.compilation_config.static_forward_context
        dtype = kvdtype.kv_dtype(self._vllm_config)  # (fp8: its bytes as float8, scaled writes)
        wrap = kvdtype.wrap_writer(dtype, self._vllm_config.model_config.dtype)
        try:
            kv_caches = kvdtype.cache_views(kv_caches, dtype)
            writers = {
                name: (
                    wrap(cache_writer(layers[name]), layers[name]),
                    layers[name].num_kv_heads,
                    layers[name].head_size,
                )
                for name in kv_caches
            }
        except Exception as exc:
            self.worker.turn_off(f"its attention layers have no cache write we can use ({exc})")
            return
        self.worker.register(kv_caches, writers)
        if dtype.itemsize == 1 and self.worker.enabled:
            scales = kvdtype.describe_scales([layers[name] for name in kv_caches])
            log.info("ctxcache connector: a %s KV cache, stored as it is (%s)", dtype, scales)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.worker is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, CtxcacheMetadata)
        self.worker.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a sync load is whole before the forward pass starts; an async one's
        # request is not in the batch until its load is

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # stores read a finished request's blocks in wait_for_save

    def wait_for_save(self) -> None:
        if self.worker is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, CtxcacheMetadata)
        self.worker.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        return self.worker.take_sent() or None, self.worker.take_loaded() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_invalid() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """While this worker is off, every step tells the scheduler half so."""
        if self.worker is None or self.worker.off is None:
            return None
        return CtxcacheWorkerMeta(off=self.worker.off)

    def get_kv_connector_stats(self) -> CtxcacheStats | None:
        side = self.worker or self.scheduler
        counts = side.counters.drain() if side is not None else {}
        return CtxcacheStats(data=counts) if counts else None

    def shutdown(self) -> None:
        for side in (self.worker, self.scheduler):
            if side is not None:
                side.close()

    # -- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.scheduler is None:
            return 0, False
        extra = self.scheduler.matched_tokens(request, num_computed_tokens)
        return extra, self.config.async_loads and extra > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self.scheduler is None:
            return
        groups = blocks.get_block_ids() if num_external_tokens > 0 else ([],)
        self.scheduler.after_alloc(request, list(groups[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.scheduler is None:
            return CtxcacheMetadata()
        plan = self.scheduler.build(scheduler_output)
        return CtxcacheMetadata(loads=plan.loads, stores=plan.stores)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.scheduler is None:
            return
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, CtxcacheWorkerMeta) and meta.off is not None:
            self.scheduler.turn_off(meta.off)
        if self.config.async_loads:
            self.scheduler.loads_reported(
                connector_output.finished_recving or (), connector_output.invalid_block_ids
            )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is None:
            return False, None
        return self.scheduler.finished(request, block_ids), None

    # -- metrics --------------------------------------------------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> CtxcacheStats:
        return CtxcacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> CtxcachePromMetrics:
        return CtxcachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _log_like_vllm() -> None:
    """Our modules log through vLLM's handlers, so their lines appear in vLLM's output."""
    handlers = logging.getLogger("vllm").handlers
    for name in ("vllm_connector", "worker.kv"):
        ours = logging.getLogger(name)
        if not ours.handlers and handlers:
            for handler in handlers:
                ours.addHandler(handler)
            ours.setLevel(logging.INFO)
            ours.propagate = False


def _key_maker(vllm_config: VllmConfig, config: ConnectorConfig) -> KeyMaker:
    model = vllm_config.model_config
    name = config.model_name or model.served_model_name or model.model
    if isinstance(name, list):
        name = name[0]
    kv = kvdtype.kv_dtype(vllm_config)  # the KV cache's dtype (fp8), not the model's
    dtype = TORCH_TO_KEY_NAME.get(kv, str(kv))
    # The scheduler names rank 0's blocks; each tensor-parallel worker stores and loads its
    # own shard under its own rank (WorkerSide.key).
    return KeyMaker(str(name), dtype, 0, vllm_config.parallel_config.tensor_parallel_size)


def unsupported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str | None:
    """What of this engine the connector cannot serve, in words, or None. It moves full
    attention's K and V in the model's dtype or a per-tensor fp8 cache's (`kvdtype`), one
    KV cache group (the blocks of `get_block_ids()[0]`): not MLA's latent cache, not a
    cache quantised with scales inside it, not Mamba/linear-attention state or a second
    group's blocks (hybrid models)."""
    model = vllm_config.model_config
    if model is not None and getattr(model, "use_mla", False):
        return "an MLA model (its latent KV cache)"
    refused = kvdtype.unsupported_cache_dtype(vllm_config)
    if refused is not None:
        return refused
    if kv_cache_config is None:
        return None
    groups = kv_cache_config.kv_cache_groups
    if len(groups) > 1:
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        return f"a hybrid model ({len(groups)} KV cache groups: {', '.join(kinds)})"
    for group in groups:
        for spec in _specs(group.kv_cache_spec):
            if isinstance(spec, MLAAttentionSpec):
                return "an MLA model (its latent KV cache)"
            if type(spec) is not FullAttentionSpec:  # (its subclasses evict or add blocks)
                return f"a model with {type(spec).__name__} layers (not plain full attention)"
            if spec.kv_quant_mode not in (KVQuantMode.NONE, KVQuantMode.FP8_PER_TENSOR):
                return f"a quantised KV cache ({spec.kv_quant_mode.name})"
    return None


def _specs(spec: KVCacheSpec) -> list[KVCacheSpec]:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return list(spec.kv_cache_specs.values())
    return [spec]


def _trace_like_vllm(vllm_config: VllmConfig) -> None:
    """Trace the connector's lookups, loads and stores when vLLM traces its requests
        (`--otlp-traces-endpoint`, which `ctxcache vllm` sets from OTEL_EXPORTER_OTLP_ENDPOINT):
        to OTEL_EXPORTER_OTLP_ENDPOINT, else to vLLM's own endpoint when it is OTLP over HTTP
        (`.../v1/traces`). Their spans join each request's trace (vLLM hands the connector the
        request's `traceparent`), as `$OTEL_SERVICE_NAME` (`ctxcache vllm` sets `vllm`: they run
    inside vLLM), else `ctxcache-connector`. Once per process."""
    endpoint = vllm_config.observability_config.otlp_traces_endpoint
    if not endpoint or tracing.enabled():
        return
    suffix = "/v1/traces"
    own = endpoint.removesuffix(suffix) if endpoint.endswith(suffix) else ""
    base = os.environ.get(tracing.ENDPOINT_ENV, "").strip() or own
    if base:
        tracing.configure("connector", endpoint=base)
