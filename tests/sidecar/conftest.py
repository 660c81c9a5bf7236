"""Sidecar fixtures: an in-process sidecar on free ports, and real `ctxcache sidecar` processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ctxcache.net import free_port
from sidecar.client import KVClient
from sidecar.service import Sidecar
from sidecar.settings import SidecarSettings
from tests.sidecar.helpers import SidecarFactory, SidecarProcess, start_local
from tests.utils import local_dir_fixture  # noqa: F401 (the local_dir fixture)


@pytest.fixture
def sidecar() -> Iterator[Sidecar]:
    """A sidecar running in this process (memory tier only), data port picked by the OS."""
    sc = Sidecar(SidecarSettings(port=0, memory_bytes=256 << 20)).start()
    try:
        yield sc
    finally:
        sc.stop()


@pytest.fixture
def client(sidecar: Sidecar) -> Iterator[KVClient]:
    with KVClient("127.0.0.1", sidecar.port) as c:
        yield c


@pytest.fixture
def sidecar_process(tmp_path: Path) -> Iterator[SidecarFactory]:
    """Start sidecar processes (same ports again for a restart); all stopped at the end."""
    started: list[SidecarProcess] = []

    def start(
        *extra: str,
        data_port: int | None = None,
        control_port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> SidecarProcess:
        control_port = control_port or free_port()
        proc = SidecarProcess(
            data_port or free_port(),
            control_port,
            *extra,
            log_path=tmp_path / f"sidecar-{control_port}.log",
            env=env,
        )
        started.append(proc)
        proc.start()
        return proc

    try:
        yield start
    finally:
        for proc in started:
            proc.stop()


@pytest.fixture
def local(local_dir: Path) -> Iterator[Sidecar]:
    """An in-process sidecar with a shared region in `local_dir` (1 MiB memory tier)."""
    sc = start_local(local_dir)
    try:
        yield sc
    finally:
        sc.stop()
