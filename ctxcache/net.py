"""Small network helpers: free ports and waiting for a service to come up."""

from __future__ import annotations

import functools
import random
import socket
import threading
import time

import httpx

_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


LOWEST = 10000  # free_port's ports: from here up to the kernel's ephemeral range


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, and one this process has not handed out before: the
    caller binds it later, so until then the kernel may offer the same port again (two
    `free_port()` calls in a row once gave a sidecar the same data and control port).

    Where the kernel says which ports it hands out by itself (Linux), the port is picked
    below that range: every outgoing connection and every `bind(port=0)` takes one from it,
    so a port picked there can be taken before its caller binds it (vLLM's minute of
    start-up once took a test gateway's). Elsewhere, the kernel's pick."""
    below = _ephemeral_start()
    for _ in range(1000):
        if below is not None and below > LOWEST + 1000:
            port = random.randrange(LOWEST, below)
            if not port_is_free(port, host):
                continue
        else:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
        with _handed_out_lock:
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise OSError(f"no free port on {host} that this process has not handed out already")


@functools.cache
def _ephemeral_start() -> int | None:
    """The first port of the kernel's ephemeral range, where it says (Linux); read once."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def wait_tcp(host: str, port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s") from None
            time.sleep(0.05)


def wait_http(url: str, timeout: float = 30.0) -> None:
    """Poll `url` until it answers 2xx."""
    deadline = time.monotonic() + timeout
    last: str = "no answer"
    with httpx.Client(timeout=1.0) as client:  # one client: not a new SSL context per poll
        while time.monotonic() < deadline:
            try:
                r = client.get(url)
                if r.is_success:
                    return
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout}s ({last})")
