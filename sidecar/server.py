"""The data port: LMCache's `lm://` protocol over plain blocking sockets, a thread each.

A connection is strictly request/response in order and its payloads are large, so a
blocking thread per connection is the simple fast design here: the expensive calls
(`recv_into`, `sendall` of megabytes) release the GIL, a PUT lands with one `recv_into`
loop straight in the block's own (never zero-filled) buffer, and a GET sends the stored
payload itself: no per-request concatenation or intermediate copies. A large payload
goes out in a write of its own after the header (`sidecar.wire.send_frames`): gathered
behind the 36-byte header it would sit off page alignment in the kernel's buffers, which
measured at about twice the kernel time per GB on loopback.

Measured and not kept (docs/benchmarks.md has the numbers): explicit socket buffer sizes;
memfd + `sendfile` (about half the GET throughput on loopback); huge pages for large
blocks (slower PUTs); `MSG_WAITALL` or `SO_RCVLOWAT` on a PUT's payload; Nagle on during
large sends; and epoll loops (two threads for all connections, bulk payloads handed to
transfer threads): ~1.2x on 256 KiB PUTs from 16 clients, but 0.8x on 4 MiB ones.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading

from sidecar.blocks import BlockMeta
from sidecar.metrics import SidecarMetrics
from sidecar.protocol import (
    REPLY,
    REPLY_MISS,
    REPLY_OK,
    REQUEST,
    Code,
    Command,
    decode_key,
    pack_reply,
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
        # The hot path, once per request: locals instead of attribute look-ups, the header
        # unpacked in place, no per-request objects beyond the key string and the block.
        size = REQUEST.size
        header = bytearray(size)
        hview = memoryview(header)
        unpack = REQUEST.unpack
        recv_into, sendall = conn.recv_into, conn.sendall
        store, metrics, limit = self.store, self.metrics, self.max_block_bytes
        bytes_in, bytes_out = metrics.bytes_in, metrics.bytes_out
        count = {int(c): metrics.requests.labels(c.name.lower()) for c in Command}
        put, get, exist = int(Command.PUT), int(Command.GET), int(Command.EXIST)
        while True:
            got = recv_into(hview, size)
            if got != size and (not got or not recv_exact(conn, hview[got:])):
                return
            command, length, fmt, dtype, _loc, s0, s1, s2, s3, raw = unpack(header)
            counter = count.get(command)
            if counter is not None:
                counter.inc()
            if command == put:
                if not 0 <= length <= limit:
                    log.warning("PUT of %d bytes is over the limit; closing", length)
                    return
                data = store.new_buffer(length)  # a slot of the shared region, or heap
                if not recv_exact(conn, memoryview(data)):
                    return  # a torn PUT is never stored
                bytes_in.inc(length)
                store.put(BlockMeta(decode_key(raw), length, fmt, dtype, (s0, s1, s2, s3)), data)
            elif command == get:
                found = store.get(decode_key(raw))
                if found is None:
                    sendall(REPLY_MISS)
                    continue
                meta, payload = found
                head = REPLY.pack(Code.SUCCESS, meta.length, meta.fmt, meta.dtype, *meta.shape, 0)
                send_frames(conn, head, payload)
                bytes_out.inc(meta.length)
            elif command == exist:
                sendall(REPLY_OK if store.exists(decode_key(raw)) else REPLY_MISS)
            elif command == Command.HEALTH:
                sendall(REPLY_OK)
            elif command == Command.LIST:
                body = "\n".join(store.keys()).encode()
                send_frames(conn, pack_reply(Code.SUCCESS, length=len(body)), body)
            else:
                log.warning("unknown command %d; closing the connection", command)
                return
