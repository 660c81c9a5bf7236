"""`ctxcache.net.free_port`: a port is handed out once per process, below the kernel's
ephemeral range where the kernel says what that is."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

import ctxcache.net
from ctxcache.net import free_port


def test_free_port_never_hands_out_a_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel may offer a port again until someone binds it; free_port skips it (where
    the ephemeral range is unknown, the kernel picks)."""
    monkeypatch.setattr(ctxcache.net, "_ephemeral_start", lambda: None)
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


def test_ports_come_from_below_the_kernels_ephemeral_range() -> None:
    """The kernel hands out ports of its ephemeral range by itself (every outgoing connection,
    every bind to port 0): one picked there could be taken before its caller binds it."""
    start = ctxcache.net._ephemeral_start()
    if start is None:
        pytest.skip("the kernel does not say its ephemeral range here")
    ports = [free_port() for _ in range(50)]
    assert all(ctxcache.net.LOWEST <= p < start for p in ports), ports
    assert len(set(ports)) == len(ports)


def test_a_taken_port_and_a_handed_out_one_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    given = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            fresh = probe.getsockname()[1]  # (free again once this closes)
        offers = iter([busy, given, fresh])
        monkeypatch.setattr(ctxcache.net, "_ephemeral_start", lambda: 65000)
        monkeypatch.setattr(ctxcache.net.random, "randrange", lambda lo, hi: next(offers))
        assert free_port() == fresh
