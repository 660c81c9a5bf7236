"""A blocking client for the sidecar's data port (LMCache's `lm://` protocol).

One TCP connection, requests answered in order; NOT thread-safe (use one per thread).
A call that fails on the socket reconnects and retries once (every command is safe to
repeat: a PUT cut short is discarded by the server), then raises `ConnectionError`.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

from sidecar.protocol import REPLY, Code, Command, Reply, Shape, pack_request, unpack_reply
from sidecar.wire import recv_exact, send_frames

log = logging.getLogger(__name__)

T = TypeVar("T")
# HEALTH and LIST carry no key, but LMCache's server parses the key field of every
# request (and drops the connection on one it cannot parse): send a well-formed one.
NO_KEY = "ctxcache@1@0@0@half"


@dataclass(slots=True)
class KVBlock:
    """What GET returns: the payload and the header fields it was stored with."""

    data: memoryview | bytearray
    fmt: int
    dtype: int
    shape: Shape


class KVClient:
    def __init__(self, host: str, port: int, *, timeout: float = 5.0) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._reply = bytearray(REPLY.size)

    @classmethod
    def from_url(cls, url: str, **kw: float) -> KVClient:
        """`lm://host:port`."""
        parts = urlsplit(url)
        if parts.scheme != "lm" or not parts.hostname or parts.port is None:
            raise ValueError(f"expected lm://host:port, got {url!r}")
        return cls(parts.hostname, parts.port, **kw)

    # ---- commands -------------------------------------------------------------------
    def put(
        self,
        key: str,
        data: bytes | bytearray | memoryview,
        *,
        fmt: int,
        dtype: int,
        shape: Shape,
    ) -> None:
        payload = memoryview(data).cast("B")
        head = pack_request(
            Command.PUT, key, length=len(payload), fmt=fmt, dtype=dtype, shape=shape
        )

        def call(sock: socket.socket) -> None:
            send_frames(sock, head, payload)

        self._call(call)

    def get(self, key: str) -> KVBlock | None:
        """The block, or None on a miss."""
        head = pack_request(Command.GET, key)

        def call(sock: socket.socket) -> KVBlock | None:
            sock.sendall(head)
            reply = self._read_reply(sock)
            if reply.code != Code.SUCCESS:
                return None
            data = bytearray(reply.length)
            _recv_exact(sock, memoryview(data))
            return KVBlock(data, reply.fmt, reply.dtype, reply.shape)

        return self._call(call)

    def get_many(self, keys: Sequence[str]) -> list[KVBlock | None]:
        """`get` of every key in one round trip: the requests go out in one write, the
        replies (each a header, then the payload on a hit) are read in order."""
        if not keys:
            return []
        heads = b"".join(pack_request(Command.GET, key) for key in keys)

        def call(sock: socket.socket) -> list[KVBlock | None]:
            sock.sendall(heads)
            out: list[KVBlock | None] = []
            for _ in keys:
                reply = self._read_reply(sock)
                if reply.code != Code.SUCCESS:
                    out.append(None)
                    continue
                data = bytearray(reply.length)
                _recv_exact(sock, memoryview(data))
                out.append(KVBlock(data, reply.fmt, reply.dtype, reply.shape))
            return out

        return self._call(call)

    def get_into(self, key: str, out: bytearray | memoryview) -> KVBlock | None:
        """Like `get`, but the payload lands in `out` (e.g. a tensor's memory) with no
        allocation; the block's `data` is then a view of `out`. A block larger than `out`
        is read into a fresh buffer instead."""
        head = pack_request(Command.GET, key)
        view = memoryview(out).cast("B")

        def call(sock: socket.socket) -> KVBlock | None:
            sock.sendall(head)
            reply = self._read_reply(sock)
            if reply.code != Code.SUCCESS:
                return None
            data = view[: reply.length] if reply.length <= len(view) else bytearray(reply.length)
            _recv_exact(sock, memoryview(data))
            return KVBlock(data, reply.fmt, reply.dtype, reply.shape)

        return self._call(call)

    def exists(self, key: str) -> bool:
        return self._simple(Command.EXIST, key)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """`exists` of every key in one round trip: the requests go out in one write and
        the server answers them in order (any lm:// server that serves a connection in
        order does, LMCache's too)."""
        if not keys:
            return []
        heads = b"".join(pack_request(Command.EXIST, key) for key in keys)

        def call(sock: socket.socket) -> list[bool]:
            sock.sendall(heads)
            replies = bytearray(REPLY.size * len(keys))
            _recv_exact(sock, memoryview(replies))
            return [
                unpack_reply(replies[i : i + REPLY.size]).code == Code.SUCCESS
                for i in range(0, len(replies), REPLY.size)
            ]

        return self._call(call)

    def health(self) -> bool:
        try:
            return self._simple(Command.HEALTH, NO_KEY)
        except ConnectionError:
            return False

    def list_keys(self) -> list[str]:
        """Every key the server holds (our sidecar; LMCache 0.5.6's server has no LIST)."""
        head = pack_request(Command.LIST, NO_KEY)

        def call(sock: socket.socket) -> list[str]:
            sock.sendall(head)
            reply = self._read_reply(sock)
            if reply.code != Code.SUCCESS:
                return []
            body = bytearray(reply.length)
            _recv_exact(sock, memoryview(body))
            return body.decode().split("\n") if body else []

        return self._call(call)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- plumbing -------------------------------------------------------------------
    def _simple(self, command: Command, key: str) -> bool:
        head = pack_request(command, key)

        def call(sock: socket.socket) -> bool:
            sock.sendall(head)
            return self._read_reply(sock).code == Code.SUCCESS

        return self._call(call)

    def _read_reply(self, sock: socket.socket) -> Reply:
        _recv_exact(sock, memoryview(self._reply))
        return unpack_reply(self._reply)

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        return self._sock

    def _call(self, fn: Callable[[socket.socket], T]) -> T:
        for attempt in (1, 2):
            try:
                return fn(self._connect())
            except OSError as exc:
                # A half-done exchange leaves the stream out of step: never reuse it.
                self.close()
                if attempt == 2:
                    raise ConnectionError(
                        f"sidecar lm://{self.host}:{self.port} unreachable: {exc}"
                    ) from exc
                log.debug("sidecar connection failed (%s); reconnecting", exc)
        raise AssertionError("unreachable")


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    if not recv_exact(sock, view):
        raise ConnectionResetError("the sidecar closed the connection mid-reply")
