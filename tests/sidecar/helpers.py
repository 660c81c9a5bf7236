"""Helpers for sidecar tests that start real `ctxcache sidecar` processes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from sidecar.client import KVClient
from sidecar.protocol import DTYPE_BFLOAT16, FMT_KV_2LTD
from sidecar.service import Sidecar
from sidecar.settings import SidecarSettings
from tests.utils import ServiceProcess

SHAPE = (2, 1, 4, 8)  # the header of the local path's test blocks (bytes are what counts)


def start_local(local_dir: Path, memory: int = 1 << 20, **kw: Any) -> Sidecar:
    """An in-process sidecar on a free data port, its memory tier in `local_dir`'s region."""
    return Sidecar(SidecarSettings(port=0, memory_bytes=memory, local_dir=local_dir, **kw)).start()


def put_tcp(sc: Sidecar, key: str, data: bytes) -> None:
    with KVClient("127.0.0.1", sc.port) as c:
        c.put(key, data, fmt=FMT_KV_2LTD, dtype=DTYPE_BFLOAT16, shape=SHAPE)
        c.health()  # PUT has no reply: a round trip after it means it was taken in


class SidecarProcess(ServiceProcess):
    """`ctxcache sidecar` as a child process: `port` is the control port, `data_port` the data."""

    def __init__(self, data_port: int, control_port: int, *extra: str, **kw: Any) -> None:
        super().__init__(
            ["sidecar", "--port", str(data_port), "--control-port", str(control_port), *extra],
            port=control_port,
            **kw,
        )
        self.data_port = data_port


SidecarFactory = Callable[..., SidecarProcess]
