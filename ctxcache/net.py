"""Small network helpers: free ports and waiting for a service to come up."""

from __future__ import annotations

import socket
import time

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
