"""Helpers for sidecar tests that start real `ctxcache sidecar` processes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.utils import ServiceProcess


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
