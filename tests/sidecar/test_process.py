"""Real `ctxcache sidecar` processes: restart with the disk tier, SIGKILL mid-PUT, encryption."""

from __future__ import annotations

import base64
import os
import socket
import time
from pathlib import Path

import httpx
import pytest

from sidecar import protocol as p
from sidecar.client import KVClient
from tests.sidecar.helpers import SidecarFactory

KB, MB = 1024, 1024 * 1024


def key(i: int, session: str = "sess") -> str:
    return f"m@1@0@{i:x}@bfloat16@s%{session}"


def wait_exists(c: KVClient, k: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not c.exists(k):
        assert time.monotonic() < deadline, f"{k} never appeared"
        time.sleep(0.02)


def test_restart_with_disk_tier_keeps_blocks_and_pins(
    sidecar_process: SidecarFactory, tmp_path: Path
) -> None:
    args = (
        "--data-dir",
        str(tmp_path / "d"),
        "--memory-bytes",
        str(MB),
        "--disk-bytes",
        str(64 * MB),
    )
    sc = sidecar_process(*args)
    port = sc.data_port
    blocks = {key(i): os.urandom(256 * KB) for i in range(12)}
    with KVClient("127.0.0.1", port) as c:
        for i, (k, data) in enumerate(blocks.items()):
            c.put(k, data, fmt=1, dtype=3, shape=(2, 1, i + 1, 0))
        assert c.exists(key(11))
    exp = time.time() + 600
    httpx.put(f"{sc.url}/sessions/sess", json={"expires_at": exp}).raise_for_status()
    sc.stop()  # SIGTERM: memory-only blocks are flushed to disk

    sc = sidecar_process(*args, data_port=port, control_port=sc.port)
    with KVClient("127.0.0.1", port) as c:
        for i, (k, data) in enumerate(blocks.items()):
            block = c.get(k)
            assert block is not None, k
            assert bytes(block.data) == data
            assert (block.fmt, block.dtype, block.shape) == (1, 3, (2, 1, i + 1, 0))
    info = httpx.get(f"{sc.url}/sessions/sess").json()
    assert info == {
        "session": "sess",
        "blocks": 12,
        "bytes": 12 * 256 * KB,
        "tokens": sum(range(1, 13)),  # block i holds i + 1 tokens (its shape says so)
        "pinned": True,
        "expires_at": exp,
    }


def test_sigkill_mid_put_never_leaves_a_wrong_block(
    sidecar_process: SidecarFactory, tmp_path: Path
) -> None:
    """Blocks bigger than the memory tier go straight to disk; kill the process while one
    is arriving or being written. After a restart the key holds the old block or the new
    one, whole, never a mix; no temporary file survives."""
    data_dir = tmp_path / "d"
    args = ("--data-dir", str(data_dir), "--memory-bytes", str(MB), "--disk-bytes", str(512 * MB))
    k = key(1)
    old = os.urandom(24 * MB)
    sc = sidecar_process(*args)
    port, control = sc.data_port, sc.port
    with KVClient("127.0.0.1", port, timeout=30) as c:
        c.put(k, old, fmt=1, dtype=3, shape=(1, 1, 1, 1))
        wait_exists(c, k)
    for variant, sent_fraction, delay in [
        ("mid-payload", 0.5, 0.0),
        ("just-sent", 1.0, 0.0),
        ("mid-write", 1.0, 0.03),
    ]:
        new = os.urandom(24 * MB)
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(
                p.pack_request(
                    p.Command.PUT, k, length=len(new), fmt=1, dtype=3, shape=(2, 2, 2, 2)
                )
            )
            s.sendall(memoryview(new)[: int(len(new) * sent_fraction)])
            time.sleep(delay)
            sc.kill()
        sc = sidecar_process(*args, data_port=port, control_port=control)
        assert not list(data_dir.glob("blocks/*.tmp")), variant
        with KVClient("127.0.0.1", port, timeout=30) as c:
            block = c.get(k)
            assert block is not None, variant  # the old block is never lost
            got = bytes(block.data)
            assert got in (old, new), f"{variant}: a torn block came back"
            if variant == "mid-payload":
                assert got == old
            assert block.shape == ((1, 1, 1, 1) if got == old else (2, 2, 2, 2))
            old = got


def test_flipped_byte_on_disk_is_a_miss(sidecar_process: SidecarFactory, tmp_path: Path) -> None:
    args = (
        "--data-dir",
        str(tmp_path / "d"),
        "--memory-bytes",
        str(MB),
        "--disk-bytes",
        str(64 * MB),
    )
    sc = sidecar_process(*args)
    port = sc.data_port
    with KVClient("127.0.0.1", port) as c:
        c.put(key(1), os.urandom(2 * MB), fmt=1, dtype=3, shape=(1, 1, 1, 1))
        c.put(key(2), good := os.urandom(2 * MB), fmt=1, dtype=3, shape=(1, 1, 1, 1))
        wait_exists(c, key(2))
    sc.stop()
    files = sorted((tmp_path / "d" / "blocks").glob("*.kv"), key=lambda f: f.stat().st_mtime)
    assert len(files) == 2
    with open(files[0], "r+b") as f:
        f.seek(MB)
        byte = f.read(1)
        f.seek(MB)
        f.write(bytes([byte[0] ^ 0x40]))
    sc = sidecar_process(*args, data_port=port, control_port=sc.port)
    with KVClient("127.0.0.1", port) as c:
        assert c.get(key(1)) is None
        assert not c.exists(key(1))
        block = c.get(key(2))
        assert block is not None and bytes(block.data) == good
    assert not files[0].exists()
    metrics = httpx.get(f"{sc.url}/metrics").text
    assert "ctxcache_sidecar_corrupt_blocks_total 1.0" in metrics


def test_encrypted_disk_tier_from_env(sidecar_process: SidecarFactory, tmp_path: Path) -> None:
    env = {
        "CTX_SIDECAR_ENCRYPTION_KEY": base64.b64encode(os.urandom(32)).decode(),
        "CTX_SIDECAR_TOKEN": "tok",
    }
    args = (
        "--data-dir",
        str(tmp_path / "d"),
        "--memory-bytes",
        str(MB),
        "--disk-bytes",
        str(64 * MB),
    )
    secret = b"top secret KV " * 20_000
    sc = sidecar_process(*args, env=env)
    port = sc.data_port
    assert httpx.get(f"{sc.url}/stats").status_code == 401
    assert httpx.get(f"{sc.url}/stats", headers={"Authorization": "Bearer tok"}).is_success
    with KVClient("127.0.0.1", port) as c:
        c.put(key(1), secret, fmt=1, dtype=3, shape=(1, 1, 1, 1))
        wait_exists(c, key(1))
    sc.stop()
    (f,) = (tmp_path / "d" / "blocks").glob("*.kv")
    assert b"top secret" not in f.read_bytes()
    sc = sidecar_process(*args, env=env, data_port=port, control_port=sc.port)
    with KVClient("127.0.0.1", port) as c:
        block = c.get(key(1))
        assert block is not None and bytes(block.data) == secret


def metric(text: str, name: str) -> float:
    """The sum of a metric's samples (over its labels) in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize("policy", ["lru", "reserve"])
def test_pin_policy_of_a_node_full_of_idle_sessions(
    sidecar_process: SidecarFactory, tmp_path: Path, policy: str
) -> None:
    """Idle pinned sessions fill memory and disk (4x what they hold); then an active session
    takes turns. `lru`: its KV is stored and read back on every turn, the idle sessions that
    made room are counted; `reserve` (first come, first served): its new blocks are refused."""
    sc = sidecar_process(
        "--data-dir",
        str(tmp_path / "d"),
        "--memory-bytes",
        str(MB),
        "--disk-bytes",
        str(2 * MB),
        "--pin-policy",
        policy,
    )
    exp = time.time() + 600
    block = 128 * KB
    with KVClient("127.0.0.1", sc.data_port) as c, httpx.Client(base_url=sc.url) as control:
        for s in range(12):  # 12 sessions x 8 blocks = 12 MiB: 4x memory + disk
            control.put(f"/sessions/idle{s}", json={"expires_at": exp}).raise_for_status()
            for i in range(8):
                c.put(key(i, f"idle{s}"), os.urandom(block), fmt=1, dtype=3, shape=(2, 1, 1, 0))
        control.put("/sessions/active", json={"expires_at": exp}).raise_for_status()
        hits = 0
        for turn in range(4):  # each turn reads its history, then stores one new block
            for i in range(turn):
                hits += c.get(key(i, "active")) is not None
            c.put(key(turn, "active"), os.urandom(block), fmt=1, dtype=3, shape=(2, 1, 1, 0))
        assert c.exists(key(3, "active")) == (policy == "lru")
        stats = control.get("/stats").json()
        text = control.get("/metrics").text
    assert stats["pin_policy"] == policy
    assert stats["memory_bytes_used"] <= MB and stats["disk_bytes_used"] <= 2 * MB
    if policy == "lru":
        assert hits == 0 + 1 + 2 + 3
        assert metric(text, "ctxcache_sidecar_pinned_dropped_sessions_total") >= 9
        assert metric(text, "ctxcache_sidecar_refused_blocks_total") == 0
    else:
        assert hits == 0
        assert metric(text, "ctxcache_sidecar_pinned_dropped_blocks_total") == 0
        assert metric(text, "ctxcache_sidecar_refused_blocks_total") >= 4
