"""The data port: LMCache's `lm://` protocol over plain blocking sockets, a thread each.

A connection is strictly request/response in order and its payloads are large, so a
blocking thread per connection is the simple fast design here: the expensive calls
(`recv_into`, `sendmsg` of megabytes) release the GIL, a PUT lands with one `recv_into`
loop straight in the block's own buffer, and a GET leaves with one gather `sendmsg` of
header + stored payload: no per-request concatenation or intermediate copies. What was
measured while choosing (docs/benchmarks.md): `sendmsg` vs two `sendall`s, explicit socket
buffer sizes vs kernel autotuning, and memfd + `sendfile` all came out within noise or
worse on loopback, so the code keeps the plainest form.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading

from sidecar.blocks import BlockMeta
from sidecar.metrics import SidecarMetrics
from sidecar.protocol import (
    REPLY_MISS,
    REPLY_OK,
    REQUEST,
    Code,
    Command,
    pack_reply,
    unpack_request,
)
from sidecar.store import BlockStore
from sidecar.wire import recv_exact, send_frames

log = logging.getLogger(__name__)


class DataServer:
    def __init__(
        self,
        store: BlockStore,
        host: str,
        port: int,
        *,
        max_block_bytes: int,
        metrics: SidecarMetrics,
    ) -> None:
        self.store = store
        self.max_block_bytes = max_block_bytes
        self.metrics = metrics
        self._listener = socket.create_server((host, port), backlog=256, reuse_port=False)
        self.port = int(self._listener.getsockname()[1])
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name="sidecar-accept", daemon=True
        )
        self._stopping = False

    def start(self) -> None:
        self._accept_thread.start()
        log.info("data port listening on %s", self._listener.getsockname())

    def stop(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._accept_thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                conn, _addr = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._conns_lock:
                self._conns.add(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="sidecar-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        self.metrics.connections.inc()
        try:
            self._loop(conn)
        except OSError as exc:
            log.debug("connection closed: %s", exc)
        except Exception:
            log.exception("data connection failed")
        finally:
            self.metrics.connections.dec()
            with self._conns_lock:
                self._conns.discard(conn)
            conn.close()

    def _loop(self, conn: socket.socket) -> None:
        header = bytearray(REQUEST.size)
        hview = memoryview(header)
        count = {int(c): self.metrics.requests.labels(c.name.lower()) for c in Command}
        while recv_exact(conn, hview):
            req = unpack_request(header)
            if req.command in count:
                count[req.command].inc()
            if req.command == Command.PUT:
                if not 0 <= req.length <= self.max_block_bytes:
                    log.warning("PUT of %d bytes is over the limit; closing", req.length)
                    return
                data = bytearray(req.length)
                if not recv_exact(conn, memoryview(data)):
                    return  # a torn PUT is never stored
                self.metrics.bytes_in.inc(req.length)
                meta = BlockMeta(req.key, req.length, req.fmt, req.dtype, req.shape)
                self.store.put(meta, data)
            elif req.command == Command.GET:
                found = self.store.get(req.key)
                if found is None:
                    conn.sendall(REPLY_MISS)
                    continue
                meta, payload = found
                head = pack_reply(
                    Code.SUCCESS,
                    length=meta.length,
                    fmt=meta.fmt,
                    dtype=meta.dtype,
                    shape=meta.shape,
                )
                send_frames(conn, head, payload)
                self.metrics.bytes_out.inc(meta.length)
            elif req.command == Command.EXIST:
                conn.sendall(REPLY_OK if self.store.exists(req.key) else REPLY_MISS)
            elif req.command == Command.HEALTH:
                conn.sendall(REPLY_OK)
            elif req.command == Command.LIST:
                body = "\n".join(self.store.keys()).encode()
                send_frames(conn, pack_reply(Code.SUCCESS, length=len(body)), body)
            else:
                log.warning("unknown command %d; closing the connection", req.command)
                return
