"""`ctxcache.net.free_port`: a port is handed out once per process."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

import ctxcache.net
from ctxcache.net import free_port


def test_free_port_never_hands_out_a_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel may offer a port again until someone binds it; free_port skips it."""
    first = free_port()
    second = free_port()
    offers: Iterator[int] = iter([first, second, first, second + 1 if second < 65535 else 1024])

    class Offering:
        """A socket whose bind to port 0 gets the next offer (the kernel's choice, scripted)."""

        def __init__(self, *args: Any) -> None:
            self.port = 0

        def __enter__(self) -> Offering:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def bind(self, address: tuple[str, int]) -> None:
            self.port = next(offers)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(ctxcache.net.socket, "socket", Offering)
    assert free_port() not in (first, second)


def test_a_free_port_is_bindable() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", free_port()))
