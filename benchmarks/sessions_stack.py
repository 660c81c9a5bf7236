"""The stack `ctxcache bench sessions` runs against, and its bulk creation of idle sessions
(see benchmarks/sessions.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

KEY, TENANT, MODEL = "sessions-key", "bench", "fake"
WORDS = ["cache", "token", "session", "prefix", "history", "worker", "block", "chunk"]
CHUNK = 256  # tokens a KV chunk of the fake engine


# -- the stack --------------------------------------------------------------------------------
@dataclass
class Stack:
    gateway: str
    redis_url: str
    sidecar: str
    pids: dict[str, int] = field(default_factory=dict)


@contextlib.contextmanager
def own_stack(args: argparse.Namespace, tmp: Path, logs: IO[str]) -> Iterator[Stack]:
    from ctxcache.net import free_port
    from ctxcache.redis_server import RedisServer
    from ctxcache.supervisor import Child, Supervisor, http_ready

    cli = [sys.executable, "-m", "ctxcache.cli"]
    with Supervisor(out=logs) as sup:
        redis = RedisServer(tmp / "redis", appendonly=False)
        redis.data_dir.mkdir(parents=True)
        rc = sup.start(Child("redis", redis.argv(), ready=redis.wait_ready))
        data_port, control_port = free_port(), free_port()
        sidecar = f"http://127.0.0.1:{control_port}"
        sc = sup.start(
            Child(
                "sidecar",
                [
                    *cli,
                    "sidecar",
                    "--port",
                    str(data_port),
                    "--control-port",
                    str(control_port),
                    "--memory-bytes",
                    str(args.sidecar_memory_mib << 20),
                ],
                ready=http_ready(f"{sidecar}/health"),
            )
        )
        port = free_port()
        worker = sup.start(
            Child(
                "worker",
                [
                    sys.executable,
                    "-m",
                    "benchmarks.fake_worker",
                    "--port",
                    str(port),
                    "--sidecar",
                    f"lm://127.0.0.1:{data_port}",
                    "--chunk-size",
                    str(CHUNK),
                    "--kv-bytes-per-token",
                    str(args.kv_bytes_per_token),
                ],
                ready=http_ready(f"http://127.0.0.1:{port}/health"),
            )
        )
        gw_port = free_port()
        gw = sup.start(
            Child(
                "gateway",
                [
                    *cli,
                    "gateway",
                    "--port",
                    str(gw_port),
                    "--redis-url",
                    redis.url,
                    "--api-key",
                    f"{KEY}={TENANT}",
                    "--worker",
                    f"w0@http://127.0.0.1:{port}={sidecar}",
                    "--log-level",
                    "WARNING",
                ],
                env={"CTX_GATEWAY_MIN_TTL": "1", "CTX_MANAGER_DEFAULT_QUOTA": QUOTA_JSON},
                startup_timeout=120.0,
                ready=http_ready(f"http://127.0.0.1:{gw_port}/ready"),
            )
        )
        pids = {
            c.name: c.proc.pid for c in (gw, sc, worker, rc) if c.proc is not None
        }  # the gateway runs the manager in its process
        yield Stack(f"http://127.0.0.1:{gw_port}", redis.url, sidecar, pids)


QUOTA_JSON = '{"max_sessions": 1000000000, "max_context_tokens": 1000000000000000}'


async def bulk_create(
    args: argparse.Namespace, stack: Stack, n: int, known: list[str], bar: Any
) -> float:
    """`n` idle sessions through the manager's own create; returns seconds taken."""
    from cache_manager.protocol import CreateSession
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
                messages = context_messages(rng, args.context_words)
                info = await service.create(
                    CreateSession(
                        tenant=TENANT,
                        model=MODEL,
                        kind="chat",
                        tokens=fake_ids(messages),
                        messages=messages,
                        ttl=3600,
                        worker="w0",
                        sidecar=stack.sidecar,
                    )
                )
                known.append(info.session_id)
                bar.update(1)

        await asyncio.gather(*(creator() for _ in range(args.bulk_concurrency)))
        await service.drain()
        await link.aclose()
    quiet.setLevel(level)
    return time.perf_counter() - t0


def context_messages(rng: random.Random, words: int) -> list[dict[str, str]]:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return [
        {"role": "system", "content": "You are a helpful assistant with a long memory."},
        {"role": "user", "content": text},
    ]


def fake_ids(messages: list[dict[str, str]]) -> list[int]:
    """The fake engine's token ids of a prefill-only chat context (its /tokenize)."""
    return list("".join(f"<{m['role']}>{m['content']}" for m in messages).encode())
