"""What the connector cannot serve — an MLA latent in fp8, a KV cache quantised with scales
inside it (per-token-head int8/fp8) or of mixed dtypes, Mamba state — it
refuses at start-up on both sides, with one log line, and vLLM runs without it: no lookup,
no load, no store planned. A worker that turns itself off later makes the scheduler half
plan nothing more.

Built from vLLM's own objects (`VllmConfig`, `KVTransferConfig`, `CacheConfig`,
`KVCacheConfig` and its specs), the sidecar a fake at the network boundary that holds every
block; `model_config` is a stand-in with the fields the connector reads (a real one needs a
checkpoint and the HF config of an MLA model).
"""

from __future__ import annotations

import logging
import pickle
import warnings
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.vllm_connector.test_plan import FakeRequest, ids
from vllm_connector.plan import LoadSpec

with warnings.catch_warnings():  # vLLM's imports warn (torch.jit deprecations)
    warnings.simplefilter("ignore", DeprecationWarning)
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheSpec,
        KVQuantMode,
        MambaSpec,
        MLAAttentionSpec,
    )
    from vllm.v1.outputs import KVConnectorOutput

    import vllm_connector.connector as connector_mod
    from vllm_connector.connector import (
        CtxcacheConnector,
        CtxcacheMetadata,
        CtxcacheWorkerMeta,
    )

BLOCK = 16
LAYERS = ["model.layers.0.attn", "model.layers.1.attn"]


def full(**kw: Any) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, **kw
    )


def kv_cache_config(*specs: KVCacheSpec) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"{LAYERS[0]}.{i}"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def vllm_config(
    *,
    cache_dtype: str = "auto",
    mla: bool = False,
    skip_layers: list[str] | None = None,
    **extra: Any,
) -> VllmConfig:
    cache = CacheConfig(block_size=BLOCK, cache_dtype=cache_dtype)  # type: ignore[arg-type]
    cache.kv_cache_dtype_skip_layers = list(skip_layers or [])
    config = VllmConfig(
        cache_config=cache,
        kv_transfer_config=KVTransferConfig(
            kv_connector="CtxcacheConnector",
            kv_connector_module_path="vllm_connector.connector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "sidecar_url": "lm://127.0.0.1:1",
                "chunk_size": 64,
                "min_load_tokens": 16,
                **extra,
            },
        ),
    )
    config.model_config = SimpleNamespace(  # type: ignore[assignment]
        use_mla=mla, served_model_name="tiny", model="tiny", dtype=torch.bfloat16
    )
    return config


class EverythingSidecar:
    """The scheduler's sidecar client: every block is there."""

    def __init__(self) -> None:
        self.calls = 0

    def exists_many(self, keys: list[str]) -> list[bool]:
        self.calls += 1
        return [True] * len(keys)

    def close(self) -> None:
        return None


@pytest.fixture
def sidecar(monkeypatch: pytest.MonkeyPatch) -> Iterator[EverythingSidecar]:
    fake = EverythingSidecar()
    monkeypatch.setattr(connector_mod, "kv_client_factory", lambda *a: lambda: fake)
    # our loggers keep to the root logger, where caplog listens (not vLLM's handlers)
    monkeypatch.setattr(connector_mod, "_log_like_vllm", lambda: None)
    monkeypatch.setattr("vllm.distributed.get_tensor_model_parallel_rank", lambda: 0)
    yield fake


def turn(connector: CtxcacheConnector, rid: str) -> tuple[int | None, CtxcacheMetadata, bool]:
    """One request through the scheduler hooks vLLM calls: its lookup, the allocation of
    what it matched, the step's plan, its end. (matched tokens, the plan, stores kept)"""
    request = FakeRequest(rid, ids(300), num_computed_tokens=300)
    matched, _ = connector.get_num_new_matched_tokens(request, 0)  # type: ignore[arg-type]
    blocks = SimpleNamespace(get_block_ids=lambda: (list(range(300 // BLOCK + 1)),))
    connector.update_state_after_alloc(request, blocks, matched or 0)  # type: ignore[arg-type]
    plan = connector.build_connector_meta(SimpleNamespace())  # type: ignore[arg-type]
    keep, _ = connector.request_finished(request, list(range(20)))  # type: ignore[arg-type]
    after = connector.build_connector_meta(SimpleNamespace())  # type: ignore[arg-type]
    assert isinstance(plan, CtxcacheMetadata) and isinstance(after, CtxcacheMetadata)
    return matched, CtxcacheMetadata(plan.loads + after.loads, plan.stores + after.stores), keep


UNSUPPORTED = {
    "mla-fp8": (
        dict(mla=True, cache_dtype="fp8"),
        kv_cache_config(
            MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
        ),
        "MLA model with a fp8 latent",
    ),
    "mla-not-mla-layers": (dict(mla=True), kv_cache_config(full()), "not plain MLA"),
    "mla-spec": (
        {},
        kv_cache_config(
            MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
        ),
        "MLA",
    ),
    "int8-per-token-head": (
        dict(cache_dtype="int8_per_token_head"),
        kv_cache_config(full()),
        "int8_per_token_head KV cache",
    ),
    "fp8-per-token-head-spec": (
        {},
        kv_cache_config(full(kv_quant_mode=KVQuantMode.FP8_PER_TOKEN_HEAD)),
        "quantised KV cache",
    ),
    "fp8-skip-layers": (
        dict(cache_dtype="fp8", skip_layers=["0"]),
        kv_cache_config(full(kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)),
        "mixed dtypes",
    ),
    "hybrid-mamba": (
        {},
        kv_cache_config(
            full(), MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,))
        ),
        "hybrid model with state-space or linear-attention layers",
    ),
    "mamba-only": (
        {},
        kv_cache_config(MambaSpec(block_size=BLOCK, shapes=((4, 8),), dtypes=(torch.float32,))),
        "KV cache group 0: MambaSpec",
    ),
}


def test_a_plain_attention_model_gets_loads_and_stores(sidecar: EverythingSidecar) -> None:
    """The control: the same steps on a model the connector serves plan a load and a
    store (so the refusals below are the refusal's doing)."""
    connector = CtxcacheConnector(
        vllm_config(), KVConnectorRole.SCHEDULER, kv_cache_config(full(sliding_window=64))
    )
    matched, plan, keep = turn(connector, "r1")
    assert matched and matched > 0 and sidecar.calls == 1
    assert [load.req_id for load in plan.loads] == ["r1"]
    assert keep and [store.req_id for store in plan.stores] == ["r1"]
    connector.shutdown()


def test_an_mla_model_gets_loads_and_stores_under_rankless_versioned_keys(
    sidecar: EverythingSidecar,
) -> None:
    """Its latent (vllm_connector/mla.py): the same keys for every tensor-parallel rank."""
    config = vllm_config(mla=True)
    config.parallel_config.tensor_parallel_size = 2
    latent = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    connector = CtxcacheConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config(latent))
    assert connector.refused is None
    matched, plan, keep = turn(connector, "r1")
    assert matched and matched > 0 and sidecar.calls == 1
    assert keep and [store.req_id for store in plan.stores] == ["r1"]
    key = plan.stores[0].pieces[0].key
    assert key.startswith("tiny@1@0@") and "@mla%1" in key
    connector.shutdown()


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_the_scheduler_refuses_what_it_cannot_serve_and_plans_nothing(
    sidecar: EverythingSidecar, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    kwargs, kv_config, what = UNSUPPORTED[case]
    caplog.set_level(logging.INFO, logger="vllm_connector")
    connector = CtxcacheConnector(vllm_config(**kwargs), KVConnectorRole.SCHEDULER, kv_config)
    assert connector.refused is not None and what in connector.refused
    matched, plan, keep = turn(connector, "r1")
    assert matched == 0 and plan.loads == [] and plan.stores == [] and not keep
    assert sidecar.calls == 0  # not even looked up
    refusals = [r for r in caplog.records if "is not supported" in r.getMessage()]
    assert len(refusals) == 1 and refusals[0].levelno == logging.ERROR
    line = refusals[0].getMessage()
    assert what in line and "LMCacheConnectorV1" in line and "without" in line
    connector.shutdown()


@pytest.mark.parametrize("case", ["mla-fp8", "int8-per-token-head", "hybrid-mamba"])
def test_the_worker_refuses_alike_and_does_nothing(
    sidecar: EverythingSidecar, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    kwargs, kv_config, _ = UNSUPPORTED[case]
    caplog.set_level(logging.INFO, logger="vllm_connector")
    connector = CtxcacheConnector(vllm_config(**kwargs), KVConnectorRole.WORKER, kv_config)
    assert connector.worker is None and connector.refused is not None
    connector.register_kv_caches({LAYERS[0]: torch.zeros(4, 2, BLOCK, 64)})  # not read
    connector.bind_connector_metadata(CtxcacheMetadata())
    connector.start_load_kv(SimpleNamespace())  # type: ignore[arg-type]
    connector.wait_for_save()
    assert connector.get_finished(set()) == (None, None)
    assert connector.get_block_ids_with_load_errors() == set()
    assert connector.build_connector_worker_meta() is None
    assert sum("is not supported" in r.getMessage() for r in caplog.records) == 1
    connector.shutdown()


def test_required_makes_a_refusal_a_start_up_error(sidecar: EverythingSidecar) -> None:
    with pytest.raises(ValueError, match=r"int8_per_token_head KV cache.*LMCacheConnectorV1"):
        CtxcacheConnector(
            vllm_config(cache_dtype="int8_per_token_head", required=True),
            KVConnectorRole.SCHEDULER,
            kv_cache_config(full()),
        )


def test_a_worker_that_turned_itself_off_stops_the_scheduler_planning_loads(
    sidecar: EverythingSidecar,
) -> None:
    """Its layout probe failed: its loads are misses in their own step, and its step
    output tells the scheduler half, which from then on plans no load and no store."""
    config, kv_config = vllm_config(), kv_cache_config(full())
    worker = CtxcacheConnector(config, KVConnectorRole.WORKER, kv_config)
    scheduler = CtxcacheConnector(config, KVConnectorRole.SCHEDULER, kv_config)
    # a layer without the cache write the probe uses
    config.compilation_config.static_forward_context = {
        LAYERS[0]: SimpleNamespace(impl=object(), num_kv_heads=2, head_size=32)
    }
    worker.register_kv_caches({LAYERS[0]: torch.zeros(4, 2, BLOCK, 64)})  # no exception
    assert worker.worker is not None and worker.worker.off is not None

    matched, plan, _ = turn(scheduler, "r1")  # planned before the scheduler heard
    assert matched and plan.loads
    worker.bind_connector_metadata(plan)
    worker.start_load_kv(SimpleNamespace())  # type: ignore[arg-type]
    (load,) = plan.loads
    blocks = load.block_ids[load.start // BLOCK : (load.end - 1) // BLOCK + 1]
    assert worker.get_block_ids_with_load_errors() == set(blocks)  # in its own step
    worker.wait_for_save()
    assert worker.get_finished(set())[0] == {"r1"}  # the store given up: blocks freed

    meta = worker.build_connector_worker_meta()
    assert isinstance(meta, CtxcacheWorkerMeta) and meta.off
    # as vLLM aggregates the workers' metadata (another worker still on) and sends it
    aggregated = CtxcacheWorkerMeta().aggregate(pickle.loads(pickle.dumps(meta)))
    scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=aggregated))
    matched, plan, keep = turn(scheduler, "r2")
    assert matched == 0 and plan.loads == [] and plan.stores == [] and not keep
    worker.shutdown()
    scheduler.shutdown()


def test_a_load_planned_for_an_off_worker_is_a_miss_in_async_mode_too(
    sidecar: EverythingSidecar,
) -> None:
    config = vllm_config(async_loads=True)
    worker = CtxcacheConnector(config, KVConnectorRole.WORKER, kv_cache_config(full()))
    assert worker.worker is not None
    worker.worker.turn_off("test")
    worker.bind_connector_metadata(CtxcacheMetadata(loads=[LoadSpec("a", 0, 64, [], [3, 4, 5, 6])]))
    worker.start_load_kv(SimpleNamespace())  # type: ignore[arg-type]
    assert worker.get_finished(set()) == (None, {"a"})  # reported in the same step
    assert worker.get_block_ids_with_load_errors() == {3, 4, 5, 6}
    worker.shutdown()
