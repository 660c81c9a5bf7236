"""API keys -> tenants. `Authorization: Bearer <key>`, compared in constant time.

The keys come from settings (`--api-key`, `CTX_GATEWAY_API_KEYS`) or a keys file that
`reload` reads again: on SIGHUP (`ctxcache gateway`), and when the file changes
(`KeysFileWatch`: Kubernetes updates a mounted Secret in place and signals no one). A
reload swaps every key at once, and a file that cannot be used keeps the keys the ring has.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Request

from ctxcache import tracing
from ctxcache.errors import InvalidAPIKey
from gateway.limits import KeyPolicy, key_digest, key_id, load_keys_file

log = logging.getLogger(__name__)

OPEN_TENANT = "default"


_KNOWN_MAX = 1024  # keys remembered as valid


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A valid key as requests see it: its tenant, its limits, its name in the store."""

    tenant: str
    id: str  # `limits.key_id`: the key's counters in the store, never the key itself
    rpm: int | None = None
    tpm: int | None = None

    @property
    def limited(self) -> bool:
        return self.rpm is not None or self.tpm is not None


OPEN_KEY = ApiKey(OPEN_TENANT, "")


class KeyRing:
    def __init__(self, keys: Mapping[str, str | KeyPolicy]) -> None:
        self._set(keys)
        if not self._keys:
            log.warning(
                "NO API KEYS CONFIGURED: the gateway is OPEN, every caller is tenant "
                "%r. Set CTX_GATEWAY_API_KEYS_FILE (or --api-key) for any shared deployment.",
                OPEN_TENANT,
            )

    def _set(self, keys: Mapping[str, str | KeyPolicy]) -> None:
        # Compare fixed-size digests: the time taken does not depend on where a guess
        # differs, nor on the length of the real keys. A key may be configured as its
        # digest (`sha256:<hex>`): then the ring never holds the key itself.
        entries = [(key_digest(k), _api_key(k, p)) for k, p in keys.items()]
        # Keys already found valid -> key: a request with a known key skips the hashing
        # (the gateway's hot path). Keyed by the key as `bearer_key` reads it, so the
        # spellings of one Authorization value share an entry; only valid keys are kept
        # (a guess is never remembered), at most _KNOWN_MAX of them.
        self._known: dict[str, ApiKey] = {}
        self._keys = entries
        self.limited = any(k.limited for _, k in entries)  # any key with a rate limit

    def replace(self, keys: Mapping[str, str | KeyPolicy]) -> None:
        """Every key at once (a key left out is refused from now on). Called on the event
        loop, between requests: none sees half of a change."""
        self._set(keys)

    def reload(self, path: Path) -> bool:
        """The keys of the keys file instead of the ring's; a file that is missing,
        unreadable or malformed changes nothing (logged, without any key)."""
        try:
            keys = load_keys_file(path)
        except ValueError as exc:  # its message names the file and the fault, never a key
            log.error("API keys NOT reloaded, the gateway keeps its keys: %s", exc)
            return False
        self.replace(keys)
        log.info(
            "API keys reloaded from %s: %d key(s) of %d tenant(s)",
            path,
            len(keys),
            len({p.tenant for p in keys.values()}),
        )
        return True

    @property
    def open(self) -> bool:
        return not self._keys

    @property
    def tenants(self) -> list[str]:
        """Every tenant a key names (the open gateway's one tenant if there are none)."""
        return sorted({k.tenant for _, k in self._keys}) if self._keys else [OPEN_TENANT]

    def tenant_for(self, authorization: str | None) -> str:
        if not self._keys:  # (open)
            return OPEN_TENANT
        return self.key_for(authorization).tenant

    def key_for(self, authorization: str | None) -> ApiKey:
        """The key an `Authorization` value presents; `invalid_api_key` if none."""
        if tracing.enabled():
            with tracing.span("ctxcache.auth"):
                return self._key_for(authorization)
        return self._key_for(authorization)

    def _key_for(self, authorization: str | None) -> ApiKey:
        if not self._keys:  # (open)
            return OPEN_KEY
        key = bearer_key(authorization)
        if key is None:
            raise InvalidAPIKey()
        if (known := self._known.get(key)) is not None:
            return known
        digest = hashlib.sha256(key.encode()).digest()
        found = None
        for known_digest, api_key in self._keys:  # no early exit: same work for every key
            if hmac.compare_digest(digest, known_digest):
                found = api_key
        if found is None:
            raise InvalidAPIKey()
        if len(self._known) < _KNOWN_MAX:
            self._known[key] = found
        return found


def bearer_key(authorization: str | None) -> str | None:
    """The key an Authorization value presents: `Bearer <key>`, the scheme in any case,
    spaces around the key ignored; None when it presents none."""
    scheme, _, key = (authorization or "").partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return None
    return key


def _api_key(key: str, policy: str | KeyPolicy) -> ApiKey:
    if isinstance(policy, str):  # a bare tenant name
        return ApiKey(policy, key_id(key))
    return ApiKey(policy.tenant, key_id(key), policy.rpm, policy.tpm)


def authorization(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The request's one Authorization header; repeated, it names no key (which one?)."""
    found = [value for name, value in headers if name == b"authorization"]
    return found[0].decode("latin-1") if len(found) == 1 else None


async def get_tenant(request: Request) -> str:
    ring: KeyRing = request.app.state.keys
    return ring.tenant_for(authorization(request.scope["headers"]))


TenantDep = Annotated[str, Depends(get_tenant)]


async def check_given_key(request: Request) -> None:
    """For a route open without a key (`/v1/models`): a request that presents one (any
    Authorization header) must present a valid one, or it is `invalid_api_key` as on every
    other route (OpenAI's SDKs check a key with `client.models.list()`)."""
    headers = request.scope["headers"]
    if any(name == b"authorization" for name, _ in headers):
        ring: KeyRing = request.app.state.keys
        ring.key_for(authorization(headers))


class KeysFileWatch:
    """Reads the keys file again when it changes: its inode, size or mtime, looked at every
    `every_s` seconds through the path (so a Kubernetes Secret volume's swap of its
    `..data` link counts, as does an editor's rename). A file that goes missing or turns
    bad keeps the keys (`KeyRing.reload` logs it once per change)."""

    def __init__(self, ring: KeyRing, path: Path, every_s: float) -> None:
        self.ring, self.path, self.every_s = ring, path, every_s
        self._seen = _stamp(path)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="keys-file")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def check(self) -> bool:
        """Reload if the file changed since it was last seen; whether the keys changed."""
        stamp = _stamp(self.path)
        if stamp == self._seen:
            return False
        self._seen = stamp
        log.info("the API keys file %s changed: reading it again", self.path)
        return self.ring.reload(self.path)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            self.check()


def _stamp(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns
