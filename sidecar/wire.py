"""Socket helpers shared by the data server and the client: exact reads, gather writes."""

from __future__ import annotations

import ctypes
import socket
from collections.abc import Callable

Buffer = bytes | bytearray | memoryview

# A payload at least this large goes out in its own write, after the header. Gathered
# behind a header of 36 or 186 bytes, every byte of it would sit that far off page
# alignment in the kernel's socket buffers, and both copies (into the sender's buffers,
# out to the receiver) run measurably slower: about twice the kernel time per GB for
# 4 MiB GETs on loopback. LMCache's own server and connector send the two separately.
SPLIT_BYTES = 64 << 10


def recv_exact(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view` from the socket; False if the peer closed first."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            return False
        got += k
    return True


def send_frames(sock: socket.socket, head: bytes, body: Buffer) -> None:
    """Send header + payload without concatenating: a small payload in one gather write,
    a large one in a write of its own so that it starts page-aligned (see SPLIT_BYTES).
    Needs TCP_NODELAY on the socket, so the header leaves at once as its own segment."""
    if len(body) >= SPLIT_BYTES:
        sock.sendall(head)
        sock.sendall(body)
        return
    total = len(head) + len(body)
    sent = sock.sendmsg([head, body])
    if sent >= total:
        return
    if sent < len(head):
        sock.sendall(memoryview(head)[sent:])
        sent = len(head)
    sock.sendall(memoryview(body)[sent - len(head) :])


def _uninitialized_bytearray() -> Callable[[int], bytearray]:
    """`bytearray(n)` zero-fills: a whole extra pass over every PUT's payload (about 240 us
    per 4 MiB here) right before `recv_into` overwrites it. CPython's own C API makes the
    buffer without the fill; a PUT only stores the buffer once it is completely received."""
    try:
        make = ctypes.pythonapi.PyByteArray_FromStringAndSize
    except AttributeError:  # not CPython
        return bytearray
    make.restype = ctypes.py_object
    make.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)

    def new(n: int) -> bytearray:
        return make(None, n)  # type: ignore[no-any-return]

    return new


new_heap_buffer = _uninitialized_bytearray()
