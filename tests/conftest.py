"""Fixtures shared by every test package: a real redis-server we start and own, the tiny
model (and the thinking one) built once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from ctxcache.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real redis-server for the whole run, on a free port, AOF on."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset (`ctxcache model create --preset tiny`), built once per run."""
    from worker.presets import create_model

    return create_model("tiny", tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def think_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The thinking preset (`--preset tiny-think`: Qwen3's `<think>` template, vLLM's `qwen3`
    reasoning parser, the think script), built once per run."""
    from worker.presets import create_model

    return create_model("tiny-think", tmp_path_factory.mktemp("models") / "tiny-think")


@pytest.fixture
def redis_url(redis_server: RedisServer) -> Iterator[str]:
    """A clean database on our own server for each test (never a server we did not start)."""
    client = redis.Redis(port=redis_server.port)
    client.flushdb()
    client.close()
    yield redis_server.url


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test alone, for tests that stop or restart it."""
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()
