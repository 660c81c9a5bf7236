"""The stack `ctxcache bench sessions` runs against, and its bulk creation of idle sessions
(see benchmarks/sessions/sessions.py). The stack comes from the one stack builder
(benchmarks/lib/stack.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cache_manager.protocol import CreateSession, SessionInfo

    Made = Callable[[CreateSession, SessionInfo], None]

KEY, TENANT, MODEL = "sessions-key", "bench", "fake"
WORDS = ["cache", "token", "session", "prefix", "history", "worker", "block", "chunk"]
CHUNK = 256  # tokens a KV chunk of the fake engine
BULK_TTL = 3600  # seconds: no bulk session expires during a run


# -- the stack --------------------------------------------------------------------------------
@dataclass
class Stack:
    gateway: str
    redis_url: str
    sidecar: str
    pids: dict[str, int] = field(default_factory=dict)


@contextlib.contextmanager
def own_stack(args: argparse.Namespace, tmp: Path, logs: IO[str]) -> Iterator[Stack]:
    """Redis, a sidecar, the fake worker storing its made-up KV there (`w0` to the
    gateway), and the gateway with a quota no bulk reaches (implicit sessions on, as by
    default)."""
    from benchmarks.lib.stack import Engine, Gateway, StackBuilder, StackSettings, SupervisorRunner
    from ctxcache.supervisor import Supervisor

    kv = ("--chunk-size", str(CHUNK), "--kv-bytes-per-token", str(args.kv_bytes_per_token))
    env = {
        "CTX_GATEWAY_MIN_TTL": "1",
        "CTX_MANAGER_DEFAULT_QUOTA": QUOTA_JSON,
        # implicit conversations are kept as long as the bulk ones (the default: 30 min)
        "CTX_GATEWAY_IMPLICIT_TTL": str(BULK_TTL),
    }
    settings = StackSettings(
        redis_appendonly=False,
        sidecar=("--memory-bytes", str(args.sidecar_memory_mib << 20)),
        engines=(Engine("fake", "worker", kv, store=True, route="w0"),),
        gateway=Gateway(keys={KEY: TENANT}, env=env),
    )
    with (
        Supervisor(out=logs) as sup,
        StackBuilder(settings, tmp, SupervisorRunner(sup)).started() as stack,
    ):
        # the gateway runs the manager in its process
        pids = {name: stack.pids[name] for name in ("gateway", "sidecar", "worker", "redis")}
        assert stack.sidecar is not None
        yield Stack(stack.gateway, stack.redis_url, stack.sidecar, pids)


QUOTA_JSON = '{"max_sessions": 1000000000, "max_context_tokens": 1000000000000000}'


async def bulk_create(
    args: argparse.Namespace,
    stack: Stack,
    n: int,
    bar: Any,
    make: Callable[[random.Random], CreateSession],
    made: Made,
) -> float:
    """`n` idle sessions through the manager's own create (`make` builds each, `made` is
    told of each created); returns seconds taken."""
    from cache_manager.redis_url import open_store_redis
    from cache_manager.service import SessionService
    from cache_manager.settings import ManagerSettings, TenantQuota
    from cache_manager.sidecar_link import BackgroundLink, SidecarLink
    from cache_manager.store import SessionStore

    class NoPins(SidecarLink):
        """The bulk sessions have no KV (no engine ran for them): nothing to pin."""

        async def pin(self, url: str, key: str, expires_at: int) -> None:
            return None

        async def drop(self, url: str, key: str) -> None:
            return None

    settings = ManagerSettings(
        redis_url=stack.redis_url,
        min_ttl=1,
        default_quota=TenantQuota(max_sessions=10**9, max_context_tokens=10**15),
    )
    rng = random.Random(n)
    quiet = logging.getLogger("cache_manager.service")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # not a line per bulk session
    t0 = time.perf_counter()
    async with open_store_redis(stack.redis_url, timeout_s=10) as redis:
        link = BackgroundLink(NoPins())
        service = SessionService(SessionStore(redis), settings, link)
        todo = iter(range(n))

        async def creator() -> None:
            for _ in todo:
                req = make(rng).model_copy(update={"worker": "w0", "sidecar": stack.sidecar})
                made(req, await service.create(req))
                bar.update(1)

        await asyncio.gather(*(creator() for _ in range(args.bulk_concurrency)))
        await service.drain()
        await link.aclose()
    quiet.setLevel(level)
    return time.perf_counter() - t0


def context_create(words: int) -> Callable[[random.Random], CreateSession]:
    """A bulk session as `POST /v1/context` with `max_tokens: 0` writes it: a 2-message
    chat context, prefill only."""

    from cache_manager.protocol import CreateSession

    def make(rng: random.Random) -> CreateSession:
        messages = context_messages(rng, words)
        return CreateSession(
            tenant=TENANT,
            model=MODEL,
            kind="chat",
            tokens=fake_ids(messages),
            messages=messages,
            ttl=BULK_TTL,
        )

    return make


def context_messages(rng: random.Random, words: int) -> list[dict[str, str]]:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return [
        {"role": "system", "content": "You are a helpful assistant with a long memory."},
        {"role": "user", "content": text},
    ]


def fake_ids(messages: list[dict[str, str]]) -> list[int]:
    """The fake engine's token ids of a prefill-only chat context (its /tokenize)."""
    return list("".join(f"<{m['role']}>{m['content']}" for m in messages).encode())
