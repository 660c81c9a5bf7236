"""`ctxcache serve --api-keys-file PATH`: its gateway reads the file (the path, never a key,
is on a command line), and a SIGHUP to serve reaches the gateway, which reads it again."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from ctxcache.net import free_port
from tests.ctxcache.test_serve import descendants, start_serve, stop_serve

OLD, NEW = "sk-serve-file-OLD-1", "sk-serve-file-NEW-2"


def write(path: Path, doc: dict[str, str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


@pytest.mark.slow  # a whole `ctxcache serve` for what gateway tests check: docs/testing.md
@pytest.mark.timeout(300)
def test_serve_passes_the_keys_file_and_a_sighup_reloads_it(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    write(keys, {OLD: "me:rpm=100"})
    port = free_port()
    log = tmp_path / "serve.log"
    proc = start_serve(tmp_path / "data", port, log, "builtin", "--api-keys-file", str(keys))
    try:
        url = f"http://127.0.0.1:{port}/v1/context"

        def status(key: str) -> int:
            return httpx.get(url, headers={"authorization": f"Bearer {key}"}).status_code

        first = httpx.get(url, headers={"authorization": f"Bearer {OLD}"})
        assert first.status_code == 200 and first.headers["x-ratelimit-limit-requests"] == "100"
        assert status(NEW) == 401
        write(keys, {NEW: "me"})
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 15
        while status(NEW) != 200:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        assert status(OLD) == 401 and proc.poll() is None  # serve goes on
        for pid in {proc.pid, *descendants(proc.pid)}:
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            assert OLD.encode() not in argv and NEW.encode() not in argv
        text = log.read_text()
        assert "API keys reloaded" in text and OLD not in text and NEW not in text
    finally:
        stop_serve(proc)
