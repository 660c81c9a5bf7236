"""Per-key rate limits, enforced in front of every route (docs/limits.md).

`RateLimits` is a plain ASGI middleware, the outermost layer of the gateway. For a request
under `/v1/` whose key has limits (`KeyPolicy.rpm` / `.tpm`) it:

1. reserves the request's tokens — an estimate of the prompt (`estimate_tokens`) plus the
   answer's maximum — and counts the request, in the key's window in the store (one
   script call on the key's slot: every gateway replica shares the budget);
2. answers `429 rate_limit_exceeded` itself when either does not fit, with `retry-after`,
   `retry-after-ms` and OpenAI's `x-ratelimit-*` headers; otherwise passes the request on
   and adds the `x-ratelimit-*` headers to the answer's head;
3. settles the reservation to the answer's real `usage.total_tokens` (a JSON answer's,
   a stream's usage chunk or `response.completed`); a stream without usage keeps the
   reservation, an error answer without usage gives it back.

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
from ctxcache.errors import CtxError, RateLimited, StoreUnavailable, error_response
from gateway.auth import ApiKey, KeyRing, authorization
from gateway.limits import MAX_LIMIT
from gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

# the routes that generate, and the default of their answer's maximum (None: the setting)
GENERATING: dict[str, int | None] = {
    "/v1/completions": None,
    "/v1/chat/completions": None,
    "/v1/responses": None,
    "/v1/context": 0,  # a create only prefills unless it asks for max_tokens
}
_MAX_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
_PROMPT_FIELDS = ("prompt", "messages", "input", "instructions")
_HUGE = 10**15  # more than any budget: a larger maximum is reserved as this
WARN_EVERY_S = 10.0  # a store outage is logged at most this often
_CAPTURE_MAX = 8 * 2**20  # a JSON answer larger than this is not parsed for its usage


def estimate_tokens(doc: Any, *, default_max_tokens: int) -> int:
    """The tokens a body may use: its prompt's estimate plus `n` times its answer's maximum.

    Before tokenization the prompt is estimated as hosted APIs do, from its size: a quarter
    of the UTF-8 bytes of the JSON of its `prompt`, `messages`, `input` and `instructions`
    (rounded up); token ids count one each. The answer's maximum is `max_tokens`
    (`max_completion_tokens`, `max_output_tokens`), else `default_max_tokens`.
    """
    if not isinstance(doc, dict):
        return 0
    prompt = 0
    for name in _PROMPT_FIELDS:
        value = doc.get(name)
        if value is None:
            continue
        if isinstance(value, list) and value and all(type(v) is int for v in value):
            prompt += len(value)  # token ids
        elif isinstance(value, str):
            prompt += -(-len(value.encode()) // 4)
        else:
            prompt += -(-len(orjson.dumps(value)) // 4)
    most = default_max_tokens
    for name in _MAX_FIELDS:
        value = doc.get(name)
        if type(value) in (int, float) and value >= 0:  # (an integer past 64 bits is a float)
            most = math.ceil(min(value, _HUGE))
            break
    n = doc.get("n")
    n = n if type(n) is int and 1 <= n <= 128 else 1
    return prompt + n * most


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

    def start(self, message: Message) -> None:
        self.status = message["status"]
        headers = [(name.lower(), value) for name, value in message.get("headers", ())]
        if any(name == b"idempotent-replayed" for name, _ in headers):
            self.total = 0  # an Idempotency-Key replay: nothing ran, nothing to charge
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

    async def _limited(self, scope: Scope, receive: Receive, send: Send, key: ApiKey) -> None:
        tenants = self.metrics.tenants
        tenants.request(key.tenant)
        reserved = 0
        generating = scope["method"] == "POST" and scope["path"] in GENERATING
        if generating and (key.tpm is not None or self.tenant_metrics):
            body = _Body(receive)
            raw = await body.read(self.max_body_bytes)
            receive = body.replay
            if raw is not None:
                doc = _parse(raw)
                default = GENERATING[scope["path"]]
                reserved = estimate_tokens(
                    doc, default_max_tokens=self.default_max_tokens if default is None else default
                )
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
                self.metrics.rate_limit_store_errors.labels(
                    "open" if self.fail_open else "closed"
                ).inc()
                if time.monotonic() - self._warned_at > WARN_EVERY_S:  # (an outage: not each)
                    self._warned_at = time.monotonic()
                    log.warning(
                        "rate limits not counted, requests %s: %s",
                        "served (fail open)" if self.fail_open else "refused (fail closed)",
                        exc,
                    )
                if not self.fail_open:
                    await error_response(
                        StoreUnavailable("rate limits cannot be counted: " + exc.message)
                    )(scope, receive, send)
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
        try:
            await self.app(scope, receive, send)
        finally:
            if usage is not None:
                await self._settle(key, window, reserved, usage)

    async def _settle(
        self, key: ApiKey, window: RateWindow | None, reserved: int, usage: _Usage
    ) -> None:
        used = usage.total
        if used is None:
            used = 0 if usage.status >= 400 or usage.status == 0 else reserved
        used = min(used, MAX_LIMIT)  # (a worker's absurd usage must not break the settle)
        self.metrics.tenants.tokens(key.tenant, used)
        if window is None or key.tpm is None or used == reserved:
            return
        try:
            await self.state.manager.rate_settle(
                key.id, RateSettle(window_end_ms=window.window_end_ms, delta=used - reserved)
            )
        except CtxError as exc:  # the reservation stays: the key's budget is off by the delta
            self.metrics.rate_limit_store_errors.labels("settle").inc()
            log.warning("rate limit reservation not settled: %s", exc)


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
