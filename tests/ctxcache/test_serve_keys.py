"""`ctxcache serve --api-key KEY=TENANT[:rpm=N][,tpm=N]`: the keys reach its gateway (in its
environment, not on any command line), with their limits."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from ctxcache.net import free_port
from tests.ctxcache.test_serve import descendants, start_serve, stop_serve

KEY = "sk-serve-secret-key"


@pytest.mark.slow  # a whole `ctxcache serve` for what gateway tests check: docs/testing.md
@pytest.mark.timeout(300)
def test_serve_passes_keys_and_limits_to_its_gateway(tmp_path: Path) -> None:
    port = free_port()
    proc = start_serve(
        tmp_path / "data", port, tmp_path / "serve.log", "builtin", "--api-key", f"{KEY}=me:rpm=2"
    )
    try:
        url = f"http://127.0.0.1:{port}/v1/context"
        assert httpx.get(url).status_code == 401  # not open any more
        auth = {"authorization": f"Bearer {KEY}"}
        first = httpx.get(url, headers=auth)
        assert first.status_code == 200
        assert first.headers["x-ratelimit-limit-requests"] == "2"
        assert httpx.get(url, headers=auth).status_code == 200
        third = httpx.get(url, headers=auth)
        assert third.status_code == 429
        assert third.json()["error"]["code"] == "rate_limit_exceeded"
        for pid in {proc.pid, *descendants(proc.pid)}:
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            assert KEY.encode() not in argv or pid == proc.pid, "a key on a child's command line"
    finally:
        stop_serve(proc)
