"""Per-tenant `cache_salt`: one tenant's requests never hit another's cached prefixes.

A worker's prefix cache (vLLM's automatic prefix caching, our worker's L1) is shared by
every request it serves, so a fast first token tells a caller that somebody already sent
the same prefix — a way to probe other tenants' prompts. vLLM's per-request `cache_salt`
closes it: requests with different salts share no cached block. The gateway adds a salt
derived from the tenant to every request it sends a worker (a client's own `cache_salt` is
kept, inside the tenant's). Sessions are unaffected: a session belongs to one tenant.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from ctxcache.errors import InvalidRequest


class CacheSalt:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._known: dict[str, str] = {}

    def of(self, tenant: str, client_salt: object = None) -> str | None:
        """The `cache_salt` to send for `tenant` (None: send none)."""
        if client_salt is not None and (not isinstance(client_salt, str) or not client_salt):
            raise InvalidRequest("cache_salt must be a non-empty string", param="cache_salt")
        if not self.enabled:
            return client_salt
        salt = self._of(tenant)
        return salt if client_salt is None else f"{salt}:{client_salt}"

    def _of(self, tenant: str) -> str:
        salt = self._known.get(tenant)
        if salt is None:
            salt = hashlib.sha256(b"ctxcache-tenant\0" + tenant.encode()).hexdigest()[:32]
            self._known[tenant] = salt
        return salt

    def apply(self, tenant: str, body: dict[str, Any]) -> bool:
        """Set `body["cache_salt"]` for `tenant`; whether the body changed."""
        salt = self.of(tenant, body.get("cache_salt"))
        if salt is None or salt == body.get("cache_salt"):
            return False
        body["cache_salt"] = salt
        return True

    def salted(self, tenant: str, doc: dict[str, Any], raw: bytes) -> bytes:
        """`raw`, the JSON of `doc`, as it goes to a worker: with `tenant`'s salt (`apply`).
        When the client sent no salt, the salt is added to the bytes as they are, not
        re-serialised (the gateway's hot path); `doc` is left as it was then."""
        if not self.enabled or not doc or "cache_salt" in doc:
            return orjson.dumps(doc) if self.apply(tenant, doc) else raw
        end = raw.rindex(b"}")  # the object's own: only whitespace may follow it
        return b'%b,"cache_salt":"%b"%b' % (raw[:end], self._of(tenant).encode(), raw[end:])
