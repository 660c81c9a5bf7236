"""Worker settings: `CTX_WORKER_*` environment variables, overridden by CLI flags."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings

from ctxcache.settings import service_config


class WorkerSettings(BaseSettings):
    model_config = service_config("worker")

    model: str = Field(description="local HF model directory, or a hub id")
    model_name: str | None = Field(None, description="served model name (default: dir name)")
    host: str = "127.0.0.1"
    port: int = 8100
    dtype: Literal["float32", "bfloat16"] = "float32"
    threads: int | None = Field(None, description="torch CPU threads (default: torch's)")

    sidecar: str | None = Field(None, description="lm://HOST:PORT of the KV sidecar")
    sidecar_timeout: float = Field(1.0, gt=0)
    sidecar_local_dir: Path | None = Field(
        None,
        description="the sidecar's --local-dir on this node: KV moves through its shared "
        "memory, the socket there carries only which blocks and a lease (lm:// when the "
        "directory or its socket is missing; docs/deploy.md, 'Shared-memory KV path')",
    )
    sidecar_tail_blocks: bool = Field(
        True, description="also store/find the last partial chunk at 16-token granularity"
    )
    chunk_size: int = Field(256, ge=16)
    l1_bytes: int = Field(1 << 30, ge=0, description="byte budget of the in-process KV L1")
    l1_tail_tokens: bool = Field(
        False,
        description="the L1 also keeps a finished sequence's last partial block, so the "
        "next turn reuses every token, not all but < 16 (cached_tokens then are not "
        "multiples of 16, as in SGLang's token-level radix cache)",
    )
    worker_id: int = 0

    max_queue: int = Field(64, ge=0, description="waiting requests before 503")
    max_batch: int = Field(8, ge=1, description="sequences decoded together")
    max_n: int = Field(16, ge=1)

    sink_tokens: int = Field(0, ge=0, description="attention-sink window: first S tokens kept")
    window_tokens: int = Field(0, ge=0, description="attention-sink window: last W tokens kept")

    @field_validator("chunk_size")
    @classmethod
    def _chunk_multiple_of_block(cls, v: int) -> int:
        if v % 16:
            raise ValueError("chunk_size must be a multiple of 16 (the L1 block size)")
        return v

    @field_validator("sidecar")
    @classmethod
    def _lm_url(cls, v: str | None) -> str | None:
        if v and not v.startswith("lm://"):
            raise ValueError("sidecar must be an lm://HOST:PORT url")
        return v or None

    @model_validator(mode="after")
    def _sink_window(self) -> WorkerSettings:
        if bool(self.sink_tokens) != bool(self.window_tokens):
            raise ValueError("set both sink_tokens and window_tokens, or neither")
        return self

    @property
    def served_name(self) -> str:
        return self.model_name or Path(self.model.rstrip("/")).name or self.model

    @property
    def sink_window(self) -> tuple[int, int] | None:
        return (self.sink_tokens, self.window_tokens) if self.window_tokens else None
