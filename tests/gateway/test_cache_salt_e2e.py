"""Tenants never share a worker's cached prefixes: the gateway salts each tenant's requests."""

from __future__ import annotations

import httpx

from tests.gateway.conftest import Stack
from tests.utils import ServiceProcess

PROMPT = " ".join(f"word{i}" for i in range(120))


def _cached(gw: ServiceProcess, key: str, *, until_hit: bool = False) -> int:
    """cached_tokens of a plain (no-session) completion; with `until_hit`, retried a few
    times, since a worker stores a request's KV just after answering it."""
    with httpx.Client(base_url=gw.url, timeout=120) as c:
        for _ in range(5 if until_hit else 1):
            r = c.post(
                "/v1/completions",
                headers={"authorization": f"Bearer {key}"},
                json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0},
            )
            assert r.status_code == 200, r.text
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            if cached or not until_hit:
                return cached
    return 0


def test_one_tenants_prefix_is_not_another_tenants_cache_hit(stack: Stack) -> None:
    # one worker, no sidecar: what one request caches is what the next one can hit
    argv = ["gateway", "--redis-url", stack.redis.url, "--worker", stack.workers[0].url]
    argv += ["--api-key", "salt-a=tenant-salt-a", "--api-key", "salt-b=tenant-salt-b"]
    with ServiceProcess(argv, log_path=stack.root / "gw-salt.log", health_path="/ready") as gw:
        assert _cached(gw, "salt-a") == 0
        assert _cached(gw, "salt-a", until_hit=True) > 0  # the same tenant reuses its prefix
        assert _cached(gw, "salt-b") == 0  # another tenant does not see it
        assert _cached(gw, "salt-b", until_hit=True) > 0
