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
