"""Socket helpers shared by the data server and the client: exact reads, gather writes."""

from __future__ import annotations

import socket

Buffer = bytes | bytearray | memoryview


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
    """Send header + payload with one gather write when it fits, never concatenating."""
    total = len(head) + len(body)
    sent = sock.sendmsg([head, body])
    if sent >= total:
        return
    if sent < len(head):
        sock.sendall(memoryview(head)[sent:])
        sent = len(head)
    sock.sendall(memoryview(body)[sent - len(head) :])
