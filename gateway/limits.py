"""API keys and their rate limits: `KEY=TENANT[:rpm=N][,tpm=N]` and its settings form.

A key names its tenant and, optionally, how many requests (`rpm`) and tokens (`tpm`) it
may use per window (a minute unless `rate_limit_window_s` says otherwise). A tenant's
budget is the sum of its keys' budgets. The counting lives in the store
(`cache_manager/ratelimits.py`), the enforcement in the gateway (`gateway/ratelimit.py`);
docs/limits.md has the whole design.

Everything here rejects what it does not understand, with a message naming the part: an
empty key or tenant, an unknown option, a limit that is not a whole number from 1 to
10^12, an option given twice. A key with no limits costs nothing at request time.
"""

from __future__ import annotations

import hashlib
import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

MAX_LIMIT = 10**12
MAX_TENANT_CHARS = 256  # the manager's bound on a tenant name
OPTIONS = ("rpm", "tpm")
_DIGITS = re.compile(r"[0-9]+")

Limit = Annotated[StrictInt, Field(gt=0, le=MAX_LIMIT)]


class KeyPolicy(BaseModel):
    """What one API key is: its tenant and its limits per window (None: no limit)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: str = Field(min_length=1, max_length=MAX_TENANT_CHARS)
    rpm: Limit | None = None
    tpm: Limit | None = None

    @model_validator(mode="after")
    def _printable_tenant(self) -> KeyPolicy:
        if not self.tenant.isprintable() or self.tenant != self.tenant.strip():
            raise ValueError(f"tenant {self.tenant!r}: no spaces around it, no control chars")
        return self

    @property
    def limited(self) -> bool:
        return self.rpm is not None or self.tpm is not None

    @classmethod
    def parse(cls, text: str) -> KeyPolicy:
        """`TENANT[:rpm=N][,tpm=N]` (the part after `KEY=`)."""
        tenant, colon, options = text.partition(":")
        fields: dict[str, Any] = {"tenant": tenant}
        if colon:
            if not options:
                raise ValueError(f"{text!r}: nothing after ':' (expected rpm=N and/or tpm=N)")
            for option in options.split(","):
                name, eq, value = option.partition("=")
                name = name.strip()
                if name not in OPTIONS:
                    raise ValueError(
                        f"{text!r}: unknown option {name!r} (the options are rpm=N and tpm=N)"
                    )
                if name in fields:
                    raise ValueError(f"{text!r}: {name} given twice")
                value = value.strip()
                if not eq or not _DIGITS.fullmatch(value):
                    raise ValueError(
                        f"{text!r}: {name} must be a whole number from 1 to {MAX_LIMIT}, "
                        f"not {value!r} (leave it out for no limit)"
                    )
                fields[name] = int(value)
        try:
            return cls(**fields)
        except ValidationError as exc:
            raise ValueError(f"{text!r}: {_first_error(exc)}") from None

    def spec(self) -> str:
        """The policy back in the flag's grammar (after `KEY=`)."""
        options = [f"{n}={v}" for n in OPTIONS if (v := getattr(self, n)) is not None]
        return self.tenant + (":" + ",".join(options) if options else "")


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    message = str(err["msg"])
    if err["type"] in ("greater_than", "less_than_equal"):
        message = f"must be a whole number from 1 to {MAX_LIMIT} (leave it out for no limit)"
    return f"{where}: {message}" if where else message


def parse_key_spec(spec: str) -> tuple[str, KeyPolicy]:
    """`KEY=TENANT[:rpm=N][,tpm=N]`, as `--api-key` takes it (the key may not hold '=')."""
    key, eq, rest = spec.partition("=")
    if not eq:
        raise ValueError("expected KEY=TENANT[:rpm=N][,tpm=N] (no '=' found)")
    if not key.strip():
        raise ValueError("the key is empty (expected KEY=TENANT[:rpm=N][,tpm=N])")
    if key != key.strip() or not key.isprintable():
        raise ValueError("the key has spaces around it or control characters")
    return key, KeyPolicy.parse(rest)


def parse_key_specs(specs: list[str]) -> dict[str, KeyPolicy]:
    """Every `--api-key` of a command line; a key given twice is an error (which tenant?)."""
    keys: dict[str, KeyPolicy] = {}
    for spec in specs:
        key, policy = parse_key_spec(spec)
        if key in keys:
            raise ValueError(
                f"a key is given twice (tenants {keys[key].tenant!r}, {policy.tenant!r})"
            )
        keys[key] = policy
    return keys


def coerce_policy(value: object) -> object:
    """A settings value: a `TENANT[:...]` string or an object; pydantic checks the object."""
    return KeyPolicy.parse(value) if isinstance(value, str) else value


def key_id(key: str) -> str:
    """The name a key's counters have in the store: never the key itself (whoever reads
    the store must not learn keys), short, one Redis Cluster hash tag per key."""
    return hashlib.sha256(b"ctxcache-rate-limit\0" + key.encode()).hexdigest()[:24]
