"""The connector's settings: `kv_connector_extra_config` of vLLM's `--kv-transfer-config`."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from ctxcache.schema import StrictModel


class ConnectorConfig(StrictModel):
    """Every key is optional but `sidecar_url`; unknown keys are an error at start-up."""

    sidecar_url: str = Field(description="lm://HOST:PORT of the KV sidecar's data port")
    local_dir: str | None = Field(
        None,
        description="the sidecar's --local-dir when it runs on this node: KV moves through "
        "its shared memory, the socket carries only leases (docs/vllm.md); unset, or no "
        "socket there: lm:// over TCP",
    )
    chunk_size: int = Field(
        256, ge=16, description="tokens per sidecar chunk (LMCache's chunk_size; keys chain on it)"
    )
    tail_tokens: int | None = Field(
        None,
        ge=0,
        description="granularity of tail blocks (the last partial chunk of a finished request)"
        "; default: vLLM's block size; 0: no tail blocks (LMCache's behaviour)",
    )
    min_load_tokens: int = Field(
        64, ge=1, description="a sidecar hit adding fewer tokens than this is not loaded"
    )
    store_sessionless: bool = Field(
        False, description="also store and look up requests that carry no session tag"
    )
    async_loads: bool = Field(
        False,
        description="load KV in a background thread (vLLM's load_kv_async): the request "
        "waits in WAITING_FOR_REMOTE_KVS while the batch runs, instead of the step that "
        "schedules it waiting for its load (docs/vllm.md)",
    )
    shm_deferred_release: bool = Field(
        True,
        description="(shm) trust a load whose lease is still valid beyond doubt without "
        "waiting for its release's answer; the release rides on the next request to the "
        "sidecar (docs/sidecar.md, invariant 8). False: every release is a round trip",
    )
    ring_slots: int = Field(
        2,
        ge=1,
        le=16,
        description="(CUDA) device slots of the copy ring every shm load and store goes "
        "through, allocated once at start-up (docs/vllm.md)",
    )
    ring_slot_mib: int = Field(
        32,
        ge=1,
        le=1024,
        description="(CUDA) MiB per ring slot: the largest piece fits one slot unsplit "
        "(a 256-token Llama-3-8B bf16 chunk is 32 MiB); a load takes no more device memory",
    )
    required: bool = Field(
        False,
        description="fail vLLM's start-up when the connector cannot serve this engine (MLA, "
        "a quantised KV cache, a Mamba hybrid without prefix caching) instead of running "
        "without the cache",
    )
    timeout_s: float = Field(2.0, gt=0, description="socket timeout of block GETs and PUTs")
    lookup_timeout_s: float = Field(
        0.5, gt=0, description="socket timeout of the scheduler's EXIST lookups"
    )
    model_name: str | None = Field(
        None, description="the model field of the keys (default: vLLM's served model name)"
    )
    max_pending_stores: int = Field(64, ge=1, description="store jobs queued before dropping")
    max_pending_store_bytes: int = Field(
        512 << 20,
        ge=1,
        description="bytes of KV queued for the sidecar before further stores are dropped",
    )

    @field_validator("sidecar_url")
    @classmethod
    def _lm_url(cls, v: str) -> str:
        if not v.startswith("lm://"):
            raise ValueError("sidecar_url must be lm://HOST:PORT")
        return v

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        return cls.model_validate(extra or {})

    def tail_granularity(self, block_size: int) -> int:
        tail = block_size if self.tail_tokens is None else self.tail_tokens
        if tail and self.chunk_size % tail:
            raise ValueError(f"tail_tokens {tail} must divide chunk_size {self.chunk_size}")
        return tail
