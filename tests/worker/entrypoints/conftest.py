from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from worker.app import create_app
from worker.engine.runner import ModelRunner
from worker.settings import WorkerSettings

ClientFactory = Callable[..., TestClient]


@pytest.fixture
def make_client(tiny_model: Path, runner: ModelRunner) -> Iterator[ClientFactory]:
    """An in-process worker app (lifespan run) sharing the session's loaded model."""
    with ExitStack() as stack:

        def make(**overrides: object) -> TestClient:
            settings = WorkerSettings(model=str(tiny_model), chunk_size=32, **overrides)
            return stack.enter_context(TestClient(create_app(settings, runner=runner)))

        yield make


@pytest.fixture
def client(make_client: ClientFactory) -> TestClient:
    return make_client()
