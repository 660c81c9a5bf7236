"""Settings helpers shared by every service.

Each service has its own pydantic-settings class (env prefix `CTX_<SERVICE>_`), built by
its app factory from CLI flags + environment, never at import time.
"""

from __future__ import annotations

import argparse
from typing import Any, TypeVar

from pydantic_settings import BaseSettings, SettingsConfigDict

S = TypeVar("S", bound=BaseSettings)


def service_config(prefix: str) -> SettingsConfigDict:
    """The model_config every service settings class uses: `CTX_<PREFIX>_*` variables."""
    return SettingsConfigDict(env_prefix=f"CTX_{prefix.upper()}_", extra="ignore")


def from_args(cls: type[S], args: argparse.Namespace, **fields: str) -> S:
    """Build settings from env, overridden by the CLI flags that were given.

    `fields` maps settings field -> argparse dest; flags left at None keep the env/default.
    """
    overrides: dict[str, Any] = {}
    for field, dest in fields.items():
        value = getattr(args, dest, None)
        if value is not None:
            overrides[field] = value
    return cls(**overrides)


def check_ttl(ttl: int | None, *, default: int, low: int, high: int) -> int:
    """A client's ttl (seconds): `default` when absent, `invalid_ttl` outside [low, high]."""
    from ctxcache.errors import InvalidTTL

    if ttl is None:
        return default
    if isinstance(ttl, bool) or not low <= ttl <= high:
        raise InvalidTTL(f"ttl must be an integer between {low} and {high} seconds", param="ttl")
    return ttl


def serve_app(app: Any, *, host: str, port: int) -> None:
    """Serve an ASGI app the way every ctxcache service does (`server_config`)."""
    import sys

    import uvicorn

    server = uvicorn.Server(server_config(app, host=host, port=port))
    server.run()
    if not server.started:  # (as `uvicorn.run`: the port is taken, the lifespan failed...)
        sys.exit(3)


# How long a service keeps an idle client connection open (uvicorn's default is 5 s). A
# client that sends on a connection just as the server closes it gets a connection reset,
# which the openai SDK retries but a load balancer answers as a 502: the server must hold
# an idle connection longer than the client or proxy in front does (AWS ALB and GCP hold
# 60 s, httpx 5 s). 75 s, nginx's own default.
KEEP_ALIVE_S = 75


def server_config(app: Any, *, host: str, port: int) -> Any:
    """The uvicorn config of every ctxcache service: uvloop, httptools with the writes of
    one loop turn sent together (`ctxcache.http_protocol`), idle connections kept
    `KEEP_ALIVE_S`, our logging; the app itself, wrapped in no middleware. Only uvicorn's
    public options: its version is pinned, and tests/ctxcache/test_server_contract.py checks
    what we rely on."""
    import uvicorn

    from ctxcache.http_protocol import CoalescingHttp

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        proxy_headers=False,  # nothing reads the client's address; saves a middleware per request
        loop="uvloop",
        http=CoalescingHttp,
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=5,
    )
