"""API keys -> tenants. `Authorization: Bearer <key>`, looked up by its SHA-256 digest.

A presented key costs one hash and one dictionary lookup whether it is right or wrong, and
however many keys there are (a wrong one was compared with every key's digest: 100,000 keys
cost 10-30 ms of the event loop per guess). What is looked up is the digest of the secret,
never the secret: how long the lookup takes can tell at most how a guess's digest relates
to the digests the ring holds, which says nothing of the keys (SHA-256 is preimage
resistant). A hit and a miss take the same path: the lookup gives an entry (a decoy for a
miss), whose digest is checked with `hmac.compare_digest`.

The keys come from settings (`--api-key`, `CTX_GATEWAY_API_KEYS`) or a keys file that
`reload` reads again: on SIGHUP (`ctxcache gateway`), and when the file changes
(`KeysFileWatch`: Kubernetes updates a mounted Secret in place and signals no one). A
reload reads, checks and hashes the file in a thread (100,000 keys take a second or two),
then swaps every key at once on the event loop; a file that cannot be used keeps the keys
the ring has.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, TypeVar

from fastapi import Depends, Request

from ctxcache import tracing
from ctxcache.errors import InvalidAPIKey
from gateway.limits import KeyPolicy, key_digest, key_id, read_keys_file

log = logging.getLogger(__name__)
T = TypeVar("T")

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


# A key in the ring: its digest, then its `ApiKey`'s fields (tenant, id, rpm, tpm). A plain
# tuple of bytes, strings and numbers, which the garbage collector stops tracking once it
# has seen it, so a ring of 100,000 keys costs its collections nothing; 100,000 ApiKey
# objects would be walked by every oldest-generation collection, the event loop stopped.
_Entry = tuple[bytes, str, str, int | None, int | None]
# What a miss finds: a digest no key has (SHA-256 of nothing a key can be: keys are not
# empty), so a miss goes through the same check as a hit and fails it.
_DECOY: _Entry = (hashlib.sha256(b"").digest(), "", "", None, None)


@dataclass(frozen=True, slots=True)
class _Keys:
    """A ring's keys made ready to swap in."""

    entries: dict[bytes, _Entry]  # by digest
    limited: bool  # any key with a rate limit
    tenants: int

    @classmethod
    def of(cls, keys: Iterable[tuple[str, str | KeyPolicy]]) -> _Keys:
        # Keyed by fixed-size digests: a lookup costs the same whatever the guess, and a
        # key may be configured as its digest (`sha256:<hex>`): then the ring never holds
        # the key itself. Two spellings of one key (itself and its digest): the last wins.
        entries = {e[0]: e for e in (_entry(k, p) for k, p in keys)}
        tenants = len({e[1] for e in entries.values()})
        limited = any(e[3] is not None or e[4] is not None for e in entries.values())
        return cls(entries, limited, tenants)

    @classmethod
    def load(cls, path: Path) -> _Keys:
        """The keys file's keys (`load_keys_file`'s ValueError if it cannot be used). Slow
        for a large file (a second for 100,000 keys): the reload runs it in a thread, which
        hands the GIL to the event loop's thread every few hundred keys (`time.sleep(0)`)
        rather than make each of its requests wait up to Python's switch interval (5 ms)
        for it, several times."""
        return cls.of(_yielding(read_keys_file(path)))


class KeyRing:
    def __init__(self, keys: Mapping[str, str | KeyPolicy]) -> None:
        self._swap(_Keys.of(keys.items()))
        self._reloading = asyncio.Lock()  # one reload at a time: the last file read wins
        if not self._keys:
            log.warning(
                "NO API KEYS CONFIGURED: the gateway is OPEN, every caller is tenant "
                "%r. Set CTX_GATEWAY_API_KEYS_FILE (or --api-key) for any shared deployment.",
                OPEN_TENANT,
            )

    def _swap(self, keys: _Keys) -> None:
        """Every key at once (a key left out is refused from now on): plain assignments on
        the event loop, between requests, so none sees half of a change."""
        # Keys already found valid -> key: a request with a known key skips the hashing
        # (the gateway's hot path). Keyed by the key as `bearer_key` reads it, so the
        # spellings of one Authorization value share an entry; only valid keys are kept
        # (a guess is never remembered), at most _KNOWN_MAX of them.
        self._known: dict[str, ApiKey] = {}
        self._keys = keys.entries
        self.limited = keys.limited

    def replace(self, keys: Mapping[str, str | KeyPolicy]) -> None:
        """Every key at once (a key left out is refused from now on)."""
        self._swap(_Keys.of(keys.items()))

    async def reload(self, path: Path) -> bool:
        """The keys of the keys file instead of the ring's; a file that is missing,
        unreadable or malformed changes nothing (logged, without any key). The file is
        read, checked and hashed in a thread, so requests are answered meanwhile; then the
        keys are swapped in at once, and the old ones freed in a thread too (freeing
        100,000 entries takes tens of milliseconds)."""
        async with self._reloading:
            try:
                keys = await asyncio.to_thread(_Keys.load, path)
            except ValueError as exc:  # its message names the file and the fault, never a key
                log.error("API keys NOT reloaded, the gateway keeps its keys: %s", exc)
                return False
            old = self._keys
            self._swap(keys)
            log.info(
                "API keys reloaded from %s: %d key(s) of %d tenant(s)",
                path,
                len(keys.entries),
                keys.tenants,
            )
            await asyncio.to_thread(_free, old)
        return True

    @property
    def open(self) -> bool:
        return not self._keys

    @property
    def tenants(self) -> list[str]:
        """Every tenant a key names (the open gateway's one tenant if there are none)."""
        return sorted({e[1] for e in self._keys.values()}) if self._keys else [OPEN_TENANT]

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
        entry = self._keys.get(digest, _DECOY)  # one lookup, hit or miss (the module's doc)
        if not hmac.compare_digest(digest, entry[0]):
            raise InvalidAPIKey()
        found = ApiKey(*entry[1:])
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


def _yielding(keys: Iterator[T], every: int = 256) -> Iterator[T]:
    """`keys`, the GIL let go every `every` of them (for a thread beside the event loop)."""
    for n, item in enumerate(keys, 1):
        yield item
        if n % every == 0:
            time.sleep(0)  # releases the GIL: a thread waiting for it takes it now


def _free(entries: dict[bytes, _Entry], every: int = 256) -> None:
    """Empty a dict nothing else refers to, a few entries at a time (as `_yielding`)."""
    while entries:
        for _ in range(min(every, len(entries))):
            entries.popitem()
        time.sleep(0)


def _entry(key: str, policy: str | KeyPolicy) -> _Entry:
    if isinstance(policy, str):  # a bare tenant name
        return key_digest(key), policy, key_id(key), None, None
    return key_digest(key), policy.tenant, key_id(key), policy.rpm, policy.tpm


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
    """Reads the keys file again when it changes: its inode, size, mtime or mode, looked at
    every `every_s` seconds through the path (so a Kubernetes Secret volume's swap of its
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

    async def check(self) -> bool:
        """Reload if the file changed since it was last seen; whether the keys changed."""
        stamp = _stamp(self.path)
        if stamp == self._seen:
            return False
        self._seen = stamp
        log.info("the API keys file %s changed: reading it again", self.path)
        return await self.ring.reload(self.path)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            await self.check()


def _stamp(path: Path) -> tuple[int, int, int, int, int] | None:
    """What says the file changed; its mode too, so that a file refused because others
    could write it is read once its owner has taken it back (`chmod go-w`)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode
