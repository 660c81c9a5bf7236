"""Manager settings: `CTX_MANAGER_*` environment variables, overridden by CLI flags."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings

from cache_manager.redis_url import parse_store_url
from ctxcache.settings import service_config


class TenantQuota(BaseModel):
    max_sessions: int = Field(10_000, ge=0)
    max_context_tokens: int = Field(100_000_000, ge=0)


class ManagerSettings(BaseSettings):
    model_config = service_config("manager")

    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8300, ge=0, le=65535, description="internal API port")
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="the session store: redis[s]://, redis[s]+cluster://, redis[s]+sentinel://",
    )
    redis_timeout_s: float = Field(2.0, gt=0, description="socket timeout of Redis calls")
    redis_wait_replicas: int = Field(
        0, ge=0, description="a write is answered once this many replicas have it (WAIT)"
    )
    redis_wait_timeout_ms: int = Field(
        500,
        ge=1,
        description="how long a write waits for them, then is answered (< redis_timeout_s)",
    )
    default_ttl: int = Field(3600, description="seconds, used when a create gives no ttl")
    min_ttl: int = Field(60, ge=1, description="smallest ttl accepted")
    max_ttl: int = Field(7 * 24 * 3600, ge=1, description="largest ttl accepted")
    lock_ttl_ms: int = Field(
        30_000,
        ge=100,
        description="a turn lock expires after this unless renewed (its turn renews it every "
        "third of it while it runs): how long a crashed holder blocks the session",
    )
    default_quota: TenantQuota = Field(TenantQuota(), description="quota of every tenant")
    tenant_quotas: dict[str, TenantQuota] = Field(
        default_factory=dict, description='per-tenant overrides, JSON: {"acme": {...}}'
    )
    sidecar_timeout_s: float = Field(1.0, gt=0, description="timeout of sidecar pin/drop calls")
    sidecar_token: str | None = Field(None, description="bearer token of the sidecars' control API")
    token: str | None = Field(None, description="shared token required on the manager API")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING, ...")

    @field_validator("redis_url")
    @classmethod
    def _store_url(cls, url: str) -> str:
        parse_store_url(url)  # a ValueError names what is wrong
        return url

    @model_validator(mode="after")
    def _ttl_bounds(self) -> ManagerSettings:
        if not self.min_ttl <= self.default_ttl <= self.max_ttl:
            raise ValueError("need min_ttl <= default_ttl <= max_ttl")
        if self.redis_wait_replicas and self.redis_wait_timeout_ms >= self.redis_timeout_s * 1000:
            # else a replica that does not answer turns every write into a socket timeout
            raise ValueError("need redis_wait_timeout_ms < redis_timeout_s")
        return self

    def quota_for(self, tenant: str) -> TenantQuota:
        return self.tenant_quotas.get(tenant, self.default_quota)
