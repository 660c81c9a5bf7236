"""Small network helpers: free ports and waiting for a service to come up."""

from __future__ import annotations

import socket
import threading
import time

import httpx

_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, and one this process has not handed out before: the
    caller binds it later, so until then the kernel may offer the same port again (two
    `free_port()` calls in a row once gave a sidecar the same data and control port)."""
    for _ in range(1000):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        with _handed_out_lock:
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise OSError(f"no free port on {host} that this process has not handed out already")


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
