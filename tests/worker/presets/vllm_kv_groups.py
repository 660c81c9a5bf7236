"""`python -m tests.worker.presets.vllm_kv_groups MODEL_DIR`: what vLLM builds of a model's
KV cache, without starting an engine; one line on stdout, `KV_GROUPS {json}` (vLLM logs
to stdout too).

vLLM's own steps, in one process: the engine config (`EngineArgs.create_engine_config`, the
CPU platform's checks included), the model's layers instantiated (random weights, nothing
loaded), each attention layer's `get_kv_cache_spec` as the model runner asks it, the KV
layout resolved as the engine core does, and `get_kv_cache_groups` with the hybrid KV-cache
manager on and off. Run as a child process: it initialises vLLM's distributed state.
"""

from __future__ import annotations

import json
import sys
from typing import Any

MARK = "KV_GROUPS "


def _spec(spec: Any) -> dict[str, Any]:
    return {
        "type": type(spec).__name__,
        "block_size": spec.block_size,
        "sliding_window": getattr(spec, "sliding_window", None),
        "head_size": getattr(spec, "head_size", None),
        "num_kv_heads": getattr(spec, "num_kv_heads", None),
        "dtype": str(getattr(spec, "dtype", None)),
    }


def kv_groups(model: str, *, max_model_len: int = 1024) -> dict[str, Any]:
    from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.network_utils import get_open_port
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import AttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec

    args = EngineArgs(model=model, max_model_len=max_model_len, dtype="float32")
    args.enforce_eager = True
    cfg = args.create_engine_config()
    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}",
            backend="gloo",
        )
        ensure_model_parallel_initialized(1, 1)
        initialize_model(vllm_config=cfg)
        layers = get_layers_from_vllm_config(cfg, AttentionLayerBase)  # type: ignore[type-abstract]
        specs = {}
        for name, layer in layers.items():
            if spec := layer.get_kv_cache_spec(cfg):
                if isinstance(spec, AttentionSpec):
                    spec = customize_attention_spec(layer.get_attn_backend(), spec)
                specs[name] = spec
        backends = get_current_attn_backends(cfg)
        layouts = [[layout.name for layout in get_supported_kv_cache_layouts(backends)]]
        resolve_kv_cache_layout(cfg, layouts, list(specs.values()))
        groups: dict[str, Any] = {}
        for hma in (True, False):
            cfg.scheduler_config.disable_hybrid_kv_cache_manager = not hma
            built = get_kv_cache_groups(cfg, dict(specs))
            groups["hma_on" if hma else "hma_off"] = [
                {"spec": _spec(g.kv_cache_spec), "layers": list(g.layer_names)} for g in built
            ]
    return {
        "architecture": cfg.model_config.architecture,
        "block_size": cfg.cache_config.block_size,
        "backends": sorted(b.get_name() for b in backends),
        "layers": {name: _spec(spec) for name, spec in specs.items()},
        "groups": groups,
    }


if __name__ == "__main__":
    print(MARK + json.dumps(kv_groups(sys.argv[1])), flush=True)
