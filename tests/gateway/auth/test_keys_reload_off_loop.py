"""A keys-file reload (SIGHUP, or the file changed) reads, checks and hashes the keys off
the event loop, then swaps them in at once: requests keep being answered while a large file
loads (issue 48: with 100,000 keys, a request sent during the reload used to wait 1.9 s).

A real `ctxcache gateway`, timed from this process over TCP: a request that arrives while
the event loop is busy waits for it, which a client in the server's own loop cannot see."""

from __future__ import annotations

import gc
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.utils import ServiceProcess

BIG = 100_000
MAX_LATENCY_S = 0.1
LAST_KEY = f"sk-big-{BIG - 1:06d}-0123456789abcdefghij"


def big_keys(path: Path) -> Path:
    """100,000 keys (~5 MB), staged beside `path`: `os.replace` puts them in place."""
    doc = {f"sk-big-{i:06d}-0123456789abcdefghij": f"tenant-{i % 100}" for i in range(BIG)}
    staged = path.with_name(path.name + ".big")
    staged.write_text(json.dumps(doc))
    return staged


def worst_latency_during(
    http: httpx.Client, reload: Callable[[], None], log: Path
) -> tuple[float, int]:
    """The slowest of the cheap requests (`/health`) sent one after another from just before
    `reload()` until the log says the keys were swapped in, and how many were sent."""
    done = log.read_text().count("API keys reloaded")
    worst, sent = 0.0, 0
    deadline = time.monotonic() + 60

    def probe() -> None:
        nonlocal worst, sent
        t0 = time.perf_counter()
        assert http.get("/health").status_code == 200
        worst = max(worst, time.perf_counter() - t0)
        sent += 1

    # this process's own collections (pytest's heap: 100 ms and more on a busy machine)
    # must not count as the gateway's
    collecting = gc.isenabled()
    gc.disable()
    try:
        for _ in range(3):
            probe()
        reload()
        while log.read_text().count("API keys reloaded") == done:
            assert time.monotonic() < deadline, "the keys were not reloaded"
            probe()
            time.sleep(0.002)
        for _ in range(3):
            probe()
    finally:
        if collecting:
            gc.enable()
    return worst, sent


def assert_answered_during(http: httpx.Client, reload: Callable[[], None], log: Path) -> None:
    """No request waits `MAX_LATENCY_S` during a reload, in the better of two: a busy
    machine stalls any process for so long once in a while, a reload that holds the event
    loop stalls requests in every one."""
    tries = [worst_latency_during(http, reload, log)]
    if tries[0][0] >= MAX_LATENCY_S:
        tries.append(worst_latency_during(http, reload, log))
    worst, sent = min(tries)
    assert worst < MAX_LATENCY_S, f"requests waited {[round(w * 1000) for w, _ in tries]} ms"
    assert sent > 10  # (requests were sent while it loaded)


@pytest.mark.timeout(120)
def test_100000_keys_reload_while_requests_are_answered(tmp_path: Path, redis_url: str) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-small": "acme"}))
    staged = big_keys(keys)
    log = tmp_path / "gateway.log"
    gateway = ServiceProcess(
        ["gateway", "--redis-url", redis_url, "--api-keys-file", str(keys)],
        log_path=log,
        env={"CTX_GATEWAY_API_KEYS_FILE_POLL_S": "0.05"},
    ).start()
    try:
        assert gateway.proc is not None
        proc = gateway.proc
        with httpx.Client(base_url=gateway.url, timeout=30) as http:

            def status(key: str) -> int:
                headers = {"authorization": f"Bearer {key}"}
                return http.get("/v1/context", headers=headers).status_code

            def change() -> None:  # (the watch reads it again)
                if staged.exists():
                    os.replace(staged, keys)
                else:
                    keys.touch()

            assert_answered_during(http, change, log)
            assert (status("sk-small"), status(LAST_KEY)) == (401, 200)

            assert_answered_during(http, lambda: proc.send_signal(signal.SIGHUP), log)
            assert (status("sk-small"), status(LAST_KEY)) == (401, 200)
    finally:
        gateway.stop()
