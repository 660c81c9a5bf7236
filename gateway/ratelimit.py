"""Per-key rate limits, enforced in front of every route (docs/limits.md).

`RateLimits` is a plain ASGI middleware, the outermost layer of the gateway. For a request
under `/v1/` whose key has limits (`KeyPolicy.rpm` / `.tpm`) it:

1. reserves the request's tokens — an estimate of the prompt (`gateway.metering`) plus
   the answer's maximum — and counts the request, in the key's window in the store (one
   script call on the key's slot: every gateway replica shares the budget);
2. answers `429 rate_limit_exceeded` itself when either does not fit, with `retry-after`,
   `retry-after-ms` and OpenAI's `x-ratelimit-*` headers; otherwise passes the request on
   and adds the `x-ratelimit-*` headers to the answer's head;
3. settles the reservation to what the request cost (`charged`): what the engine reported
   doing for it (`gateway.metering`: its usage, the tokens a cut stream relayed), else the
   answer's real `usage.total_tokens` (a JSON answer's, a stream's usage chunk or
   `response.completed`); only a request that never reached the engine is given its
   reservation back. A settlement that comes after its window ended counts in the next.

Keys without limits cost one dictionary lookup (none at all when no key has limits). A
store that cannot count fails open (served, uncounted) or closed (`503`), as
`rate_limit_on_store_error` says, and is counted either way.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cache_manager.protocol import RateSettle, RateTake, RateWindow
from ctxcache.errors import CtxError, ManagerRefused, RateLimited, StoreUnavailable, error_response
from gateway.auth import ApiKey, KeyRing, authorization
from gateway.limits import MAX_LIMIT
from gateway.metering import Estimate, Meter, bind, estimate, unbind
from gateway.metering import estimate_tokens as estimate_tokens  # (the API it had)
from gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

# the routes that generate: the default of their answer's maximum (None: the setting), and
# the fields the engine may take it from (vLLM's chat honours `max_completion_tokens` over
# `max_tokens`, ctxcache's worker and session turns the other way round: both count)
GENERATING: dict[str, tuple[int | None, tuple[str, ...]]] = {
    "/v1/completions": (None, ("max_tokens",)),
    "/v1/chat/completions": (None, ("max_tokens", "max_completion_tokens")),
    "/v1/responses": (None, ("max_output_tokens",)),
    "/v1/context": (0, ("max_tokens",)),  # a create only prefills unless it asks for more
}
WARN_EVERY_S = 10.0  # a store outage is logged at most this often
_CAPTURE_MAX = 8 * 2**20  # a JSON answer larger than this is not parsed for its usage


def _parse(raw: bytes) -> Any:
    """The body as JSON; None if it is not (the app answers that)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def duration(ms: int) -> str:
    """A reset time as OpenAI writes it: `20ms`, `1.5s`, `6m0s`."""
    if ms < 1000:
        return f"{ms}ms"
    if ms < 60_000:
        return f"{ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    minutes, rest = divmod(ms, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{seconds}s"


def rate_headers(key: ApiKey, window: RateWindow) -> list[tuple[bytes, bytes]]:
    """OpenAI's `x-ratelimit-*` headers for the limits the key has."""
    reset = duration(window.reset_ms).encode()
    headers = []
    if key.rpm is not None:
        headers += [
            (b"x-ratelimit-limit-requests", str(key.rpm).encode()),
            (b"x-ratelimit-remaining-requests", str(max(0, key.rpm - window.requests)).encode()),
            (b"x-ratelimit-reset-requests", reset),
        ]
    if key.tpm is not None:
        headers += [
            (b"x-ratelimit-limit-tokens", str(key.tpm).encode()),
            (b"x-ratelimit-remaining-tokens", str(max(0, key.tpm - window.tokens)).encode()),
            (b"x-ratelimit-reset-tokens", reset),
        ]
    return headers


def refusal(key: ApiKey, window: RateWindow, reserved: int) -> RateLimited:
    """The 429 of a request that did not fit, with the wait until the window ends."""
    wait_ms = max(1, window.reset_ms)
    if key.rpm is not None and window.requests + 1 > key.rpm:
        what = f"requests per minute (rpm): limit {key.rpm}, used {window.requests}, requested 1"
    else:
        what = (
            f"tokens per minute (tpm): limit {key.tpm}, used {window.tokens}, requested {reserved}"
        )
    headers = {name.decode(): value.decode() for name, value in rate_headers(key, window)}
    headers["retry-after"] = str(math.ceil(wait_ms / 1000))
    headers["retry-after-ms"] = str(wait_ms)
    message = f"Rate limit reached for {what}. Please try again in {duration(wait_ms)}."
    return RateLimited(message, headers=headers)


def too_large(key: ApiKey, reserved: int) -> RateLimited:
    """A request whose reservation alone exceeds the key's tpm: no wait makes it fit, so
    the SDK is told not to retry (`x-should-retry: false`, which the openai SDK obeys)."""
    return RateLimited(
        f"Request too large for tokens per minute (tpm): limit {key.tpm}, requested "
        f"{reserved} (the prompt's estimate plus max_tokens). Lower max_tokens or the input.",
        headers={"x-should-retry": "false"},
    )


class _Body:
    """The request body read ahead (to estimate its tokens), replayed to the app."""

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.messages: list[Message] = []

    async def read(self, limit: int) -> bytes | None:
        """The whole body; None past `limit` bytes or if the client left (the app then
        reads the rest and answers as it always does)."""
        size = 0
        while True:
            message = await self.receive()
            self.messages.append(message)
            if message["type"] != "http.request":
                return None
            size += len(message.get("body", b""))
            if size > limit:
                return None
            if not message.get("more_body", False):
                return b"".join(m.get("body", b"") for m in self.messages)

    async def replay(self) -> Message:
        if self.messages:
            return self.messages.pop(0)
        return await self.receive()


class _Usage:
    """Finds `usage.total_tokens` in an answer as it passes: a JSON body, or a stream's
    `data:` line (a completion's usage chunk, the Responses `response.completed`)."""

    def __init__(self) -> None:
        self.status = 0
        self.kind = ""  # "json" | "sse" | "" (not looked at)
        self.parts: list[bytes] = []
        self.size = 0
        self.pending = b""
        self.total: int | None = None
        self.replayed = False

    def start(self, message: Message) -> None:
        self.status = message["status"]
        headers = [(name.lower(), value) for name, value in message.get("headers", ())]
        if any(name == b"idempotent-replayed" for name, _ in headers):
            self.total = 0  # an Idempotency-Key replay: nothing ran, nothing to charge
            self.replayed = True
            return
        for name, value in headers:
            if name == b"content-type":
                if value.startswith(b"application/json"):
                    self.kind = "json"
                elif value.startswith(b"text/event-stream"):
                    self.kind = "sse"

    def body(self, chunk: bytes) -> None:
        if self.kind == "json":
            self.size += len(chunk)
            if self.size <= _CAPTURE_MAX:
                self.parts.append(chunk)
        elif self.kind == "sse" and chunk:
            *lines, self.pending = (self.pending + chunk).split(b"\n")
            for line in lines:
                if line.startswith(b"data:") and b'"total_tokens"' in line:
                    self._found(line[5:])

    def end(self) -> None:
        if self.kind == "json" and self.size <= _CAPTURE_MAX:
            self._found(b"".join(self.parts))

    def _found(self, text: bytes) -> None:
        try:
            doc = orjson.loads(text)
        except orjson.JSONDecodeError:
            return
        if not isinstance(doc, dict):
            return
        usage = doc.get("usage")
        if usage is None and isinstance(doc.get("response"), dict):
            usage = doc["response"].get("usage")
        total = usage.get("total_tokens") if isinstance(usage, dict) else None
        if type(total) is int and total >= 0:
            self.total = total


class RateLimits:
    """The ASGI middleware (see the module). `state` is the app's: `keys` and `manager`
    are there once its lifespan ran."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        state: Any,
        metrics: GatewayMetrics,
        window_s: float,
        on_store_error: str,
        default_max_tokens: int,
        max_body_bytes: int,
        tenant_metrics: bool = False,
    ) -> None:
        self.app = app
        self.state = state
        self.metrics = metrics
        self.window_ms = max(1, round(window_s * 1000))
        self.fail_open = on_store_error == "open"
        self.default_max_tokens = default_max_tokens
        self.max_body_bytes = max_body_bytes
        self.tenant_metrics = tenant_metrics
        self._warned_at = -WARN_EVERY_S

    def engaged(self, key: ApiKey) -> bool:
        """Whether this key's requests are looked at (limits, or per-tenant metrics)."""
        return key.limited or self.tenant_metrics

    def key_of(self, scope: Scope) -> ApiKey | None:
        """The request's key if this layer has work to do for it."""
        ring: KeyRing | None = getattr(self.state, "keys", None)
        if ring is None or not (ring.limited or self.tenant_metrics) or ring.open:
            return None
        if not scope["path"].startswith("/v1/"):
            return None
        try:
            key = ring.key_for(authorization(scope["headers"]))
        except CtxError:  # the app answers 401
            return None
        return key if self.engaged(key) else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        key = self.key_of(scope)
        if key is None:
            await self.app(scope, receive, send)
            return
        await self._limited(scope, receive, send, key)

    def _store_error(self, exc: CtxError) -> CtxError | None:
        """A check the store could not answer: the error to answer (None: serve uncounted).

        The manager service refusing the gateway itself (401: the manager token does not
        match; 404: a manager too old to have the limits route; any 4xx) is a
        misconfiguration, not an outage — served uncounted, every limited key would be free
        until someone read a warning. Such requests are refused whatever
        `rate_limit_on_store_error` says, logged at error level and counted as
        `misconfigured`. A store that cannot count (down, failing over, refusing writes:
        `store_unavailable`) serves or refuses as the setting says."""
        answered = exc.answered if isinstance(exc, ManagerRefused) else exc.status
        misconfigured = answered < 500
        outcome = "misconfigured" if misconfigured else "open" if self.fail_open else "closed"
        self.metrics.rate_limit_store_errors.labels(outcome).inc()
        if time.monotonic() - self._warned_at > WARN_EVERY_S:  # (an outage: not each)
            self._warned_at = time.monotonic()
            if misconfigured:
                log.error(
                    "rate limits cannot be counted, requests of limited keys refused: the "
                    "manager answered %d (%s); check CTX_GATEWAY_MANAGER_TOKEN, and that the "
                    "manager is not older than the gateway",
                    answered,
                    exc.message,
                )
            else:
                log.warning(
                    "rate limits not counted, requests %s: %s",
                    "served (fail open)" if self.fail_open else "refused (fail closed)",
                    exc,
                )
        if misconfigured:
            return StoreUnavailable(
                f"rate limits cannot be counted: the manager refused the gateway "
                f"(misconfigured: {answered} {exc.message})"
            )
        if self.fail_open:
            return None
        return StoreUnavailable("rate limits cannot be counted: " + exc.message)

    async def _limited(self, scope: Scope, receive: Receive, send: Send, key: ApiKey) -> None:
        tenants = self.metrics.tenants
        tenants.request(key.tenant)
        reserved, meter = 0, None
        generating = scope["method"] == "POST" and scope["path"] in GENERATING
        if generating and (key.tpm is not None or self.tenant_metrics):
            body = _Body(receive)
            raw = await body.read(self.max_body_bytes)
            receive = body.replay
            guess = Estimate(0, 0)
            if raw is not None:
                default, fields = GENERATING[scope["path"]]
                guess = estimate(
                    _parse(raw),
                    default_max_tokens=self.default_max_tokens if default is None else default,
                    max_fields=fields,
                )
            reserved, meter = guess.total, Meter(guess.prompt)
        window: RateWindow | None = None
        if key.limited:
            if key.tpm is not None and reserved > key.tpm:
                tenants.limited(key.tenant, "tokens")
                self.metrics.rate_limited.labels("too_large").inc()
                await error_response(too_large(key, reserved))(scope, receive, send)
                return
            try:
                window = await self.state.manager.rate_take(
                    key.id,
                    RateTake(
                        window_ms=self.window_ms,
                        max_requests=key.rpm or 0,
                        max_tokens=key.tpm or 0,
                        tokens=reserved if key.tpm is not None else 0,
                    ),
                )
            except CtxError as exc:
                refused = self._store_error(exc)
                if refused is not None:
                    await error_response(refused)(scope, receive, send)
                    return
            if window is not None and not window.allowed:
                limit = (
                    "requests"
                    if key.rpm is not None and window.requests + 1 > key.rpm
                    else "tokens"
                )
                tenants.limited(key.tenant, limit)
                self.metrics.rate_limited.labels(limit).inc()
                await error_response(refusal(key, window, reserved))(scope, receive, send)
                return
        usage = _Usage() if generating else None
        extra = rate_headers(key, window) if window is not None else []
        send = _wrap_send(send, extra, usage)
        token = bind(meter)  # the app reports its calls to the engine there
        try:
            await self.app(scope, receive, send)
        finally:
            unbind(token)
            if usage is not None:
                await self._settle(key, window, reserved, charged(usage, meter, reserved))

    async def _settle(
        self, key: ApiKey, window: RateWindow | None, reserved: int, used: int
    ) -> None:
        used = min(used, MAX_LIMIT)  # (a worker's absurd usage must not break the settle)
        self.metrics.tenants.tokens(key.tenant, used)
        if window is None or key.tpm is None or used == reserved:
            return
        try:
            await self.state.manager.rate_settle(
                key.id,
                RateSettle(
                    window_end_ms=window.window_end_ms,
                    delta=used - reserved,
                    window_ms=self.window_ms,  # (a late difference opens the next window)
                ),
            )
        except CtxError as exc:  # the reservation stays: the key's budget is off by the delta
            self.metrics.rate_limit_store_errors.labels("settle").inc()
            log.warning("rate limit reservation not settled: %s", exc)


def charged(usage: _Usage, meter: Meter | None, reserved: int) -> int:
    """What a request costs (docs/limits.md, "What counts"): what the engine reported doing
    for it (`gateway.metering`), else the usage its answer shows, else its reservation if
    it was answered, nothing if it failed or its client left before any engine call."""
    if usage.replayed:
        return 0
    if meter is not None and (used := meter.charge(reserved, usage.total)) is not None:
        return used
    if usage.total is not None:
        return usage.total
    return 0 if usage.status >= 400 or usage.status == 0 else reserved


def _wrap_send(send: Send, extra: list[tuple[bytes, bytes]], usage: _Usage | None) -> Send:
    async def wrapped(message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if extra:
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            if usage is not None:
                usage.start(message)
        elif kind == "http.response.body" and usage is not None:
            usage.body(message.get("body", b""))
            if not message.get("more_body", False):
                usage.end()
        await send(message)

    return wrapped
