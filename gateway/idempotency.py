"""`Idempotency-Key`: a retried write answers what its first attempt answered (docs/limits.md).

The gateway reads and checks the header, names the key's record (a hash of tenant + key:
keys are scoped per tenant) and hashes the request it came with (route, session, body — its
JSON as the gateway reads it, not its bytes: a client that serialises the same body again
with other key order or spacing sends the same request), and the manager keeps the record
in the written session's hash slot, written by the same script as the turn or the create
it records. A create (its session id is new) gets an id derived from the tenant and the
key, so a retry finds the session its first attempt made. A retry of a streamed request
gets the recorded answer as a stream of the same shape.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import orjson
from fastapi import Depends, Request

from cache_manager.protocol import Idempotency
from ctxcache.errors import InvalidRequest
from ctxcache.responses import JSONResponse
from gateway.auth import TenantDep

HEADER = "idempotency-key"
# on a replayed answer (Stripe's name): nothing ran, so the rate limiter charges no tokens
REPLAYED = {"idempotent-replayed": "true"}
MAX_KEY_CHARS = 255  # Stripe's limit; an SDK's `stainless-python-retry-<uuid>` is 59


def check_header(values: list[str]) -> str | None:
    """The header's one value, or None if absent; `invalid_request` if it is unusable."""
    if not values:
        return None
    if len(values) > 1:
        raise InvalidRequest("give one Idempotency-Key header, not several", param=HEADER)
    key = values[0]
    if not key:
        raise InvalidRequest("Idempotency-Key is empty", param=HEADER)
    if len(key) > MAX_KEY_CHARS:
        raise InvalidRequest(
            f"Idempotency-Key is longer than {MAX_KEY_CHARS} characters", param=HEADER
        )
    if key != key.strip() or any(not 0x20 <= ord(c) < 0x7F for c in key):
        raise InvalidRequest(
            "Idempotency-Key must be printable ASCII (no control characters, no leading or "
            "trailing spaces)",
            param=HEADER,
        )
    return key


@dataclass(frozen=True)
class IdempotencyKey:
    """A checked key of one request: its record's name and the request's hash."""

    tenant: str
    key: str
    request: str  # sha256 of route, session and body
    ttl_s: int

    @classmethod
    def of(
        cls, value: str | None, tenant: str, route: str, raw: bytes, *, ttl_s: int, scope: str = ""
    ) -> IdempotencyKey | None:
        """The request's key (None without the header). `scope`: what else names the write
        besides the body (a session id given in a header)."""
        if value is None:
            return None
        h = hashlib.sha256()
        for part in (route.encode(), scope.encode(), canonical(raw)):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        return cls(tenant, value, h.hexdigest(), ttl_s)

    @property
    def name(self) -> str:
        return _digest("record", self.tenant, self.key).hex()[:32]

    def session_id(self) -> str:
        """The id of the session a create with this key makes: 192 bits from the tenant
        and the key, so a retry finds it (the tenant check guards it like any other id)."""
        body = base64.urlsafe_b64encode(_digest("session", self.tenant, self.key)).decode()
        return "ctx_" + body[:32]

    def record(self, answer: dict[str, Any] | None = None) -> Idempotency:
        return Idempotency(key=self.name, body=self.request, ttl_s=self.ttl_s, answer=answer)


def canonical(raw: bytes) -> bytes:
    """A body as its request's hash sees it: its JSON as the gateway reads it (orjson),
    written again with sorted keys and no spaces, so that key order, spacing and a float's
    spelling (`1e2`, `100.0`) do not make another request. A body that is not JSON (the
    route refuses it): as it is."""
    try:
        return orjson.dumps(orjson.loads(raw), option=orjson.OPT_SORT_KEYS)
    except (orjson.JSONDecodeError, orjson.JSONEncodeError):
        return raw


def answered(answer: dict[str, Any], *, replayed: bool) -> JSONResponse:
    """A write's JSON answer; a replay of a recorded one says so (`idempotent-replayed`)."""
    return JSONResponse(answer, headers=REPLAYED if replayed else None)


def _digest(purpose: str, tenant: str, key: str) -> bytes:
    h = hashlib.sha256(b"ctxcache idempotency\0")
    for part in (purpose, tenant, key):
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


def with_session(answer: dict[str, Any], session: dict[str, Any]) -> dict[str, Any]:
    """A recorded answer, with the session as its write left it (`session_id`, `session`)."""
    return {**answer, "session_id": session["session_id"], "session": session}


KeyOf = Callable[[bytes], IdempotencyKey | None]


async def idempotency_of(request: Request, tenant: TenantDep) -> KeyOf:
    """The route's `Idempotency-Key`, checked before the body is read; the key of a request
    is made from its raw body (`key(raw)`)."""
    value = check_header(request.headers.getlist(HEADER))
    ttl_s: int = request.app.state.idempotency_ttl_s
    route = request.url.path

    def key(raw: bytes) -> IdempotencyKey | None:
        return IdempotencyKey.of(value, tenant, route, raw, ttl_s=ttl_s)

    return key


IdempotencyDep = Annotated[KeyOf, Depends(idempotency_of)]
