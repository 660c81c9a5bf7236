"""API keys -> tenants. `Authorization: Bearer <key>`, compared in constant time."""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterable
from typing import Annotated

from fastapi import Depends, Request

from ctxcache import tracing
from ctxcache.errors import InvalidAPIKey

log = logging.getLogger(__name__)

OPEN_TENANT = "default"


_KNOWN_MAX = 1024  # Authorization values remembered as valid


class KeyRing:
    def __init__(self, keys: dict[str, str]) -> None:
        # Compare fixed-size digests: the time taken does not depend on where a guess
        # differs, nor on the length of the real keys.
        self._keys = [(hashlib.sha256(k.encode()).digest(), t) for k, t in keys.items()]
        # Authorization values already found valid -> tenant: a request with a known
        # value skips the hashing (the gateway's hot path). Only valid values are kept
        # (a guess is never remembered), at most _KNOWN_MAX of them.
        self._known: dict[str, str] = {}
        if not self._keys:
            log.warning(
                "NO API KEYS CONFIGURED: the gateway is OPEN, every caller is tenant "
                "%r. Set CTX_GATEWAY_API_KEYS or --api-key for any shared deployment.",
                OPEN_TENANT,
            )

    @property
    def open(self) -> bool:
        return not self._keys

    @property
    def tenants(self) -> list[str]:
        """Every tenant a key names (the open gateway's one tenant if there are none)."""
        return sorted({t for _, t in self._keys}) if self._keys else [OPEN_TENANT]

    def tenant_for(self, authorization: str | None) -> str:
        if tracing.enabled():
            with tracing.span("ctxcache.auth"):
                return self._tenant_for(authorization)
        return self._tenant_for(authorization)

    def _tenant_for(self, authorization: str | None) -> str:
        if not self._keys:  # (open)
            return OPEN_TENANT
        if authorization is not None and (known := self._known.get(authorization)):
            return known
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise InvalidAPIKey()
        digest = hashlib.sha256(key.strip().encode()).digest()
        found = None
        for known, tenant in self._keys:  # no early exit: same work for every key
            if hmac.compare_digest(digest, known):
                found = tenant
        if found is None:
            raise InvalidAPIKey()
        if authorization is not None and len(self._known) < _KNOWN_MAX:
            self._known[authorization] = found
        return found


def authorization(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The request's one Authorization header; repeated, it names no key (which one?)."""
    found = [value for name, value in headers if name == b"authorization"]
    return found[0].decode("latin-1") if len(found) == 1 else None


async def get_tenant(request: Request) -> str:
    ring: KeyRing = request.app.state.keys
    return ring.tenant_for(authorization(request.scope["headers"]))


TenantDep = Annotated[str, Depends(get_tenant)]
