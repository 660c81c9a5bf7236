"""Sidecar settings: `CTX_SIDECAR_*` environment variables, overridden by CLI flags."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings

from ctxcache.settings import service_config


class SidecarSettings(BaseSettings):
    model_config = service_config("sidecar")

    host: str = "127.0.0.1"
    port: int = Field(65432, ge=0, le=65535, description="data port (LMCache lm:// protocol)")
    control_port: int = Field(8200, ge=0, le=65535, description="control HTTP API")
    data_dir: Path | None = Field(None, description="disk tier directory; none: memory only")
    memory_bytes: int = Field(4 << 30, ge=0, description="memory tier budget")
    disk_bytes: int = Field(0, ge=0, description="disk tier budget (needs data_dir)")
    token: SecretStr | None = Field(None, description="bearer token the control API requires")
    encryption_key: SecretStr | None = Field(
        None, description="base64 of a 32-byte AES-256-GCM key for the disk tier"
    )
    pin_policy: Literal["lru", "reserve"] = Field(
        "lru",
        description="lru: pins are a priority, the least recently used pinned sessions leave "
        "memory, then disk, to make room; reserve: pinned bytes are reserved up to memory + "
        "disk, and new pinned blocks past that are refused (docs/sidecar.md, 'Pin policy')",
    )
    local_dir: Path | None = Field(
        None,
        description="memory-backed directory shared with engines on this node: the memory "
        "tier lives in a shared region there and engines copy KV through it (docs/sidecar.md)",
    )
    local_bytes: int | None = Field(
        None, gt=0, description="size of the shared region (default: memory_bytes * 1.125)"
    )
    lease_timeout_s: float = Field(
        30.0, gt=0, description="a local lease not released by then ends (its copies: misses)"
    )
    max_block_bytes: int = Field(1 << 30, gt=0, description="largest PUT accepted")
    reap_interval: float = Field(1.0, gt=0, description="seconds between expiry sweeps")
    flush_on_shutdown: bool = Field(
        True, description="on a clean stop, write memory-only blocks to the disk tier"
    )
    write_behind_s: float = Field(
        1.0,
        ge=0,
        description="seconds between write-behind passes: pinned blocks only in memory get a "
        "disk copy in free disk room, so sessions' KV survives a kill -9 (0: off)",
    )
    cold_kv: Literal["off", "fp8"] = Field(
        "off",
        description="fp8: keep bf16/fp16/fp32 KV as fp8 (e4m3) with a scale per token row in "
        "memory and on disk, about half the bytes, unpacked on every load; never on an fp8 "
        "KV cache (docs/sidecar.md, 'Compressed tiers')",
    )
    state_blocks_per_session: int = Field(
        2,
        ge=0,
        description="a session's newest recurrent-state blocks kept (a hybrid model's, one "
        "per turn, docs/sidecar.md); older ones are dropped (0: keep every one)",
    )
    log_level: str | None = None

    @field_validator("encryption_key")
    @classmethod
    def _key_is_32_bytes(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(decode_key(v)) != 32:
            raise ValueError("encryption_key must be base64 of exactly 32 bytes")
        return v

    @property
    def disk_enabled(self) -> bool:
        return self.data_dir is not None and self.disk_bytes > 0

    @property
    def region_bytes(self) -> int:
        """The shared region's size: the memory tier plus room for fragmentation and for
        slots that leases and sends hold after the store let their blocks go."""
        return self.local_bytes or self.memory_bytes + self.memory_bytes // 8

    @property
    def aes_key(self) -> bytes | None:
        return decode_key(self.encryption_key) if self.encryption_key is not None else None


def decode_key(v: SecretStr) -> bytes:
    try:
        return base64.b64decode(v.get_secret_value(), validate=True)
    except ValueError as exc:
        raise ValueError("encryption_key is not valid base64") from exc
