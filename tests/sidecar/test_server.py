"""The data port with our client: round trips, misses, LIST, many concurrent clients."""

from __future__ import annotations

import os
import random
import socket
import threading
from pathlib import Path

from sidecar import protocol as p
from sidecar.client import KVClient
from sidecar.service import Sidecar
from sidecar.settings import SidecarSettings
from sidecar.wire import SPLIT_BYTES

KEY = "m@1@0@abc@bfloat16@s%sess"


def test_put_get_exists_round_trip(client: KVClient) -> None:
    data = os.urandom(3 << 20)
    client.put(KEY, data, fmt=p.FMT_KV_2LTD, dtype=p.DTYPE_BFLOAT16, shape=(2, 4, 256, 384))
    assert client.exists(KEY)
    block = client.get(KEY)
    assert block is not None
    assert bytes(block.data) == data
    assert (block.fmt, block.dtype, block.shape) == (1, 3, (2, 4, 256, 384))
    out = bytearray(4 << 20)
    into = client.get_into(KEY, out)
    assert into is not None and bytes(into.data) == data and into.data.obj is out
    assert client.health()


def test_payload_sizes_around_the_split_and_buffer_reuse(sidecar: Sidecar) -> None:
    """Payloads just under, at and over the size where header and payload go out in separate
    writes (both directions), read back byte for byte, on a raw socket too; the server's
    PUT buffers are never zero-filled, so a shorter block stored after a longer one (heap
    memory reused) must not show any of the older bytes."""
    sizes = [0, 1, SPLIT_BYTES - 1, SPLIT_BYTES, SPLIT_BYTES + 1, 3 << 20, 5000]
    blocks = {f"m@1@0@{i:x}@half": bytes([i + 1]) * n for i, n in enumerate(sizes)}
    with KVClient("127.0.0.1", sidecar.port) as c:
        for rounds in range(2):
            for k, data in blocks.items():
                c.put(k, data, fmt=1, dtype=2, shape=(len(data), rounds, 0, 0))
            for k, data in blocks.items():
                block = c.get(k)
                assert block is not None and bytes(block.data) == data
                assert block.shape == (len(data), rounds, 0, 0)
    with socket.create_connection(("127.0.0.1", sidecar.port)) as s:
        for k, data in blocks.items():
            s.sendall(p.pack_request(p.Command.GET, k))
            want = p.pack_reply(200, length=len(data), shape=(len(data), 1, 0, 0)) + data
            got = bytearray()
            while len(got) < len(want):
                chunk = s.recv(len(want) - len(got))
                assert chunk
                got += chunk
            assert got == want


def test_exists_many_answers_every_key_in_order_in_one_round_trip(client: KVClient) -> None:
    keys = [f"m@1@0@{i:032x}@bfloat16@s%sess" for i in range(40)]
    for key in keys[::3]:
        client.put(key, b"kv", fmt=p.FMT_KV_2LTD, dtype=p.DTYPE_BFLOAT16, shape=(2, 1, 1, 1))
    assert client.exists_many(keys) == [i % 3 == 0 for i in range(40)]
    assert client.exists_many([]) == []
    # the connection is still in step: the next call answers its own key
    assert client.exists(keys[1]) is False and client.exists(keys[3]) is True


def test_get_many_returns_hits_and_misses_in_order_in_one_round_trip(client: KVClient) -> None:
    payloads = {f"m@1@0@{i:032x}@bfloat16@s%sess": os.urandom(1000 + 4099 * i) for i in range(6)}
    keys = list(payloads)
    for key in keys[::2]:
        client.put(
            key, payloads[key], fmt=p.FMT_KV_2LTD, dtype=p.DTYPE_BFLOAT16, shape=(2, 1, 1, 3)
        )
    got = client.get_many([*keys, keys[0]])
    assert [b is not None for b in got] == [True, False, True, False, True, False, True]
    for key, block in zip([*keys, keys[0]], got, strict=True):
        if block is not None:
            assert bytes(block.data) == payloads[key] and block.shape == (2, 1, 1, 3)
    assert client.get_many([]) == []
    assert client.exists(keys[2]) is True  # the connection is still in step


def test_miss_and_empty_payload(client: KVClient) -> None:
    assert client.get("m@1@0@f00@half") is None
    assert not client.exists("m@1@0@f00@half")
    client.put("empty@1@0@1@half", b"", fmt=1, dtype=2, shape=(0, 0, 0, 0))
    block = client.get("empty@1@0@1@half")
    assert block is not None and len(block.data) == 0


def test_miss_reply_is_lmcache_shaped(sidecar: Sidecar) -> None:
    with socket.create_connection(("127.0.0.1", sidecar.port)) as s:
        s.sendall(p.pack_request(p.Command.GET, "nope@1@0@1@half"))
        assert s.recv(64) == p.REPLY_MISS


def test_pipelined_requests_are_answered_in_order(sidecar: Sidecar) -> None:
    frames = b"".join(
        p.pack_request(p.Command.PUT, f"k@1@0@{i}@half", length=4, shape=(1, 0, 0, 0))
        + i.to_bytes(4, "little")
        for i in range(5)
    )
    frames += b"".join(p.pack_request(p.Command.GET, f"k@1@0@{i}@half") for i in (3, 1, 9))
    with socket.create_connection(("127.0.0.1", sidecar.port)) as s:
        s.sendall(frames)
        want = b""
        for i in (3, 1):
            want += p.pack_reply(200, length=4, fmt=1, dtype=2, shape=(1, 0, 0, 0))
            want += i.to_bytes(4, "little")
        want += p.REPLY_MISS
        got = b""
        while len(got) < len(want):
            chunk = s.recv(4096)
            assert chunk
            got += chunk
        assert got == want


def test_list_keys(client: KVClient) -> None:
    keys = {f"m@1@0@{i:x}@half" for i in range(5)}
    for k in keys:
        client.put(k, b"x", fmt=1, dtype=2, shape=(1, 0, 0, 0))
    assert set(client.list_keys()) == keys


def test_client_reconnects_after_server_drops_connection(sidecar: Sidecar) -> None:
    with KVClient("127.0.0.1", sidecar.port) as c:
        c.put(KEY, b"abc", fmt=1, dtype=2, shape=(3, 0, 0, 0))
        assert c.exists(KEY)  # PUT has no reply: this barrier makes sure it was stored
        assert sidecar.server is not None
        for conn in list(sidecar.server._conns):
            conn.shutdown(socket.SHUT_RDWR)
        block = c.get(KEY)
        assert block is not None and bytes(block.data) == b"abc"


def test_64_concurrent_clients_mixed_put_get(sidecar: Sidecar) -> None:
    errors: list[str] = []
    start = threading.Barrier(64)

    def worker(n: int) -> None:
        rng = random.Random(n)
        mine: dict[str, tuple[bytes, tuple[int, int, int, int]]] = {}
        try:
            with KVClient("127.0.0.1", sidecar.port, timeout=30) as c:
                start.wait()
                for i in range(12):
                    if mine and rng.random() < 0.5:
                        k = rng.choice(list(mine))
                        block = c.get(k)
                        if block is None or (bytes(block.data), block.shape) != mine[k]:
                            errors.append(f"client {n}: wrong block for {k}")
                    else:
                        k = f"m@1@{n}@{i:x}@half"
                        data = rng.randbytes(rng.choice((1, 4096, 300_000)))
                        shape = (len(data), n, i, 0)
                        c.put(k, data, fmt=1, dtype=2, shape=shape)
                        mine[k] = (data, shape)
                for k, want in mine.items():
                    block = c.get(k)
                    if block is None or (bytes(block.data), block.shape) != want:
                        errors.append(f"client {n}: final check failed for {k}")
        except Exception as exc:
            errors.append(f"client {n}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors[:5]


def test_bad_frames_close_only_that_connection(sidecar: Sidecar, client: KVClient) -> None:
    for frame in (
        p.pack_request(p.Command.PUT, "k@1@0@1@half", length=-5),
        p.pack_request(99, "k@1@0@1@half"),
    ):
        with socket.create_connection(("127.0.0.1", sidecar.port)) as s:
            s.sendall(frame)
            s.settimeout(10)
            assert s.recv(64) == b""  # closed, nothing stored, nothing answered
    assert client.health()
    assert client.list_keys() == []


def test_disk_tier_through_the_data_port(tmp_path: Path) -> None:
    """A memory tier of 1 MiB under 16 clients of 300 KB blocks: most PUTs spill and most
    GETs read the disk, concurrently; every byte comes back right, and clients that leave
    with a GET pending harm no one."""
    settings = SidecarSettings(
        port=0, memory_bytes=1 << 20, data_dir=tmp_path, disk_bytes=256 << 20
    )
    sc = Sidecar(settings).start()
    errors: list[str] = []

    def worker(n: int) -> None:
        rng = random.Random(n)
        mine: dict[str, bytes] = {}
        try:
            with KVClient("127.0.0.1", sc.port, timeout=30) as c:
                for i in range(10):
                    k = f"m@1@{n}@{i:x}@half"
                    mine[k] = rng.randbytes(300_000)
                    c.put(k, mine[k], fmt=1, dtype=2, shape=(300_000, 0, 0, 0))
                for k in rng.sample(list(mine), len(mine)):
                    block = c.get(k)
                    if block is None or bytes(block.data) != mine[k]:
                        errors.append(f"client {n}: wrong block for {k}")
        except Exception as exc:
            errors.append(f"client {n}: {exc!r}")

    try:
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(16)]
        for t in threads:
            t.start()
        for _ in range(20):  # GETs whose clients are gone before the disk answers
            with socket.create_connection(("127.0.0.1", sc.port)) as s:
                s.sendall(p.pack_request(p.Command.GET, "m@1@0@0@half"))
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors[:5]
        stats = sc.store.stats()
        assert stats["disk_blocks"] >= 100 and stats["memory_bytes_used"] <= 1 << 20
        assert sc.metrics.spills._value.get() > 0
        with KVClient("127.0.0.1", sc.port) as c:
            assert c.health()
    finally:
        sc.stop()
