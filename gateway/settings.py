"""Gateway settings: `CTX_GATEWAY_*` environment variables, overridden by CLI flags."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode

from ctxcache.settings import service_config
from gateway.limits import KeyPolicy, check_keys, load_keys_file, parse_keys_json


class WorkerEndpoint(BaseModel):
    """An inference worker (ours or vLLM) and the control URL of the sidecar it stores into."""

    id: str
    url: str
    sidecar: str | None = None

    @classmethod
    def parse(cls, spec: str, index: int) -> WorkerEndpoint:
        """`URL` or `URL=SIDECAR_CONTROL_URL`, optionally prefixed `ID@`."""
        wid = f"w{index}"
        if "@" in spec.split("://", 1)[0]:
            wid, spec = spec.split("@", 1)
        url, _, sidecar = spec.partition("=")
        return cls(id=wid, url=url.rstrip("/"), sidecar=sidecar.rstrip("/") or None)


class GatewaySettings(BaseSettings):
    model_config = service_config("gateway")

    host: str = Field("127.0.0.1", description="bind address")
    port: int = Field(8000, ge=0, le=65535, description="the OpenAI API port")
    workers: list[WorkerEndpoint] = Field(
        default_factory=list, description="JSON list of {id, url, sidecar}"
    )
    manager_url: str | None = Field(None, description="the manager service; unset: in-process")
    manager_token: str | None = Field(None, description="shared token of the manager service")
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="store of the in-process manager (CTX_MANAGER_REDIS_URL's grammar)",
    )
    # NoDecode: the JSON is parsed here, where a key given twice is an error
    api_keys: Annotated[dict[str, KeyPolicy], NoDecode] = Field(
        default_factory=dict,
        description='JSON {"<key>": "<tenant>[:rpm=N][,tpm=N]"} (or {"tenant", "rpm", "tpm"} '
        "objects); empty: open. Prefer API_KEYS_FILE",
    )
    api_keys_file: Path | None = Field(
        None,
        description='a file of API_KEYS\' JSON (a key may be given as "sha256:<hex>", its '
        "digest), read at start, on SIGHUP and when it changes (docs/limits.md); not with "
        "API_KEYS",
    )
    api_keys_file_poll_s: float = Field(
        10.0,
        ge=0,
        description="how often the keys file is checked for a change, which reloads it as "
        "SIGHUP does (a Kubernetes Secret updated in place); 0: only on SIGHUP",
    )
    rate_limit_window_s: float = Field(
        60.0,
        ge=0.1,
        le=3600.0,
        description="the window rpm and tpm count over (a minute; shorter in tests)",
    )
    rate_limit_on_store_error: Literal["open", "closed"] = Field(
        "open",
        description="the store cannot count: open (serve, uncounted) or closed (503); "
        "counted in ctxcache_gateway_rate_limit_store_errors_total either way",
    )
    rate_limit_default_max_tokens: int = Field(
        256,
        ge=0,
        le=10**9,
        description="tokens a tpm key reserves for the answer of a body that names no max",
    )
    metrics_token: str | None = Field(
        None,
        min_length=16,
        description="bearer token of GET /metrics/tenants (per-tenant counters); unset: off",
    )
    default_ttl: int = Field(3600, description="seconds, when a create gives no ttl")
    min_ttl: int = Field(60, description="smallest ttl a client may ask for")
    max_ttl: int = Field(7 * 24 * 3600, description="largest ttl a client may ask for")
    max_body_bytes: int = Field(8 * 2**20, ge=1024, description="larger bodies get 413")
    request_timeout_s: float = Field(300.0, gt=0, description="a whole worker call")
    connect_timeout_s: float = Field(2.0, gt=0, description="connecting to a worker")
    health_interval_s: float = Field(2.0, gt=0, description="seconds between worker checks")
    imbalance_slack: int = Field(
        4,
        ge=0,
        description="in-flight requests an affine worker may run above the least "
        "loaded one before a session turn goes elsewhere",
    )
    max_inflight_per_worker: int = Field(64, ge=1, description="then a turn goes elsewhere")
    tenant_cache_salt: bool = Field(
        True,
        description="add a per-tenant cache_salt to worker requests (vLLM >= 0.9 prefix-cache "
        "isolation, docs/reliability.md); off for a worker that rejects the field",
    )
    recent_chat_sessions: int = Field(
        1024,
        ge=0,
        description="chat histories kept in memory to render a turn early; 0: none",
    )
    implicit_sessions: bool = Field(
        True,
        description="serve a chat request without a session that resends a conversation "
        "this gateway answered as a turn of it (docs/implicit.md); off: passed through",
    )
    implicit_off_tenants: list[str] = Field(
        default_factory=list,
        description="JSON list of tenants whose requests never become implicit sessions",
    )
    implicit_ttl: int = Field(
        1800,
        ge=1,
        description="seconds an implicit session's state is kept idle (OpenAI's in_memory "
        "retention; prompt_cache_retention 24h keeps it a day)",
    )
    implicit_max_points: int = Field(
        64,
        ge=1,
        le=128,
        description="a request's latest answers whose states are looked for (longest first)",
    )
    implicit_min_prefix_tokens: int = Field(
        128,
        ge=1,
        description="a system prompt (or a prompt_cache_breakpoint's prefix) shorter than "
        "this is not kept for other conversations to share",
    )
    idempotency_ttl_s: int = Field(
        86_400,
        ge=60,
        le=30 * 86_400,
        description="how long an Idempotency-Key's recorded answer is kept (docs/limits.md)",
    )
    reasoning_parser: str | None = Field(
        None,
        description="the --reasoning-parser the engines run (docs/reasoning.md): chat turns "
        "then run on the engine's chat endpoint, which puts the thinking in reasoning; unset: "
        "none, and a request that asks for thinking is refused",
    )
    create_priority: int = Field(
        0,
        description="vLLM scheduling priority of a create's prefill, turns being 0 (lower "
        "runs first; needs vLLM's --scheduling-policy priority); 0: none sent",
    )
    components_file: Path | None = Field(
        None,
        description="the status file of ctxcache serve's supervisor: /ready, retry-after "
        "and ctxcache_component_* metrics report its components (serve sets it)",
    )
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING, ...")

    @field_validator("api_keys", mode="before")
    @classmethod
    def _api_keys(cls, value: object) -> object:
        if isinstance(value, str | bytes):  # the environment's JSON
            return parse_keys_json(value)
        if isinstance(value, Mapping):
            return check_keys(value.items())
        return value

    @field_validator("api_keys_file", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("reasoning_parser", mode="before")
    @classmethod
    def _no_parser(cls, value: object) -> object:
        return None if value in ("", "none") else value

    @model_validator(mode="after")
    def _keys_from_file(self) -> GatewaySettings:
        """The keys file is read here, so settings that name one never make an open
        gateway; `KeyRing.reload` reads it again on SIGHUP."""
        if self.api_keys_file is None:
            return self
        if self.api_keys:
            raise ValueError(
                "API keys are given both in a keys file (API_KEYS_FILE, --api-keys-file) and "
                "as API_KEYS / --api-key: give them one way"
            )
        self.api_keys = load_keys_file(self.api_keys_file)
        return self

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, value: object) -> object:
        if isinstance(value, list):
            return [
                WorkerEndpoint.parse(v, i) if isinstance(v, str) else v for i, v in enumerate(value)
            ]
        return value
