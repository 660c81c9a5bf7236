"""API keys' rate-limit windows in the store: one Lua script, one key per API key.

    rl:{<key id>}  hash  r: requests, t: tokens, w: the window's end (ms); PEXPIREAT w

The key id is a digest of the API key (`gateway.limits.key_id`), never the key. The
limits come with each call: the gateway owns the key configuration, the store only counts,
so every gateway replica in front of the store shares one budget per key. A window opens
with the key's first request and lasts `window_ms` (fixed window; docs/limits.md).
"""

from __future__ import annotations

from cache_manager.protocol import RateSettle, RateTake, RateWindow
from cache_manager.redis_url import StoreRedis
from cache_manager.scripts import load_script
from cache_manager.store_errors import redis_errors


def rate_key(key_id: str) -> str:
    return f"rl:{{{key_id}}}"


class RateLimitStore:
    """Every method is one round trip (one script call on the key's slot)."""

    def __init__(self, redis: StoreRedis) -> None:
        self._script = load_script(redis, "ratelimit")

    async def take(self, key_id: str, req: RateTake) -> RateWindow:
        args = ["take", req.window_ms, req.max_requests, req.max_tokens, req.tokens]
        async with redis_errors():
            res = await self._script(keys=[rate_key(key_id)], args=args)
        allowed, requests, tokens, reset_ms, end_ms = (int(x) for x in res)
        return RateWindow.model_construct(
            allowed=allowed == 1,
            requests=requests,
            tokens=tokens,
            reset_ms=max(0, reset_ms),
            window_end_ms=end_ms,
        )

    async def settle(self, key_id: str, req: RateSettle) -> bool:
        """Whether the difference was counted: in its own window, or (a charge beyond the
        reservation, after that window ended) in the current one. A refund to a window that
        ended is dropped: the tokens it gave back were counted in a window that is gone."""
        if req.delta == 0:
            return True
        args = ["settle", req.window_end_ms, req.delta, req.window_ms]
        async with redis_errors():
            res = await self._script(keys=[rate_key(key_id)], args=args)
        return int(res[0]) != 0
