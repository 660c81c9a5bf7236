"""Interop with the real thing, lmcache==0.5.6 on CPU, both ways.

- LMCache's own client (`LMCServerConnector`, the class vLLM + LMCache use for
  `remote_url: lm://...`) stores into and loads from our sidecar process.
- Our `KVClient` stores into and loads from LMCache's reference server
  (`python -m lmcache.v1.server HOST PORT cpu`).
- Header bytes: LMCache's `ClientMetaMessage`/`ServerMetaMessage` against ours.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ctxcache.net import free_port, wait_tcp
from sidecar import protocol as p
from sidecar.client import KVClient
from tests.sidecar.helpers import SidecarFactory

torch = pytest.importorskip("torch")
with warnings.catch_warnings():
    # LMCache's logger uses opentelemetry's deprecated LoggingHandler when opentelemetry is
    # installed (vLLM brings it): not ours to fix
    warnings.filterwarnings("ignore", "`LoggingHandler`", DeprecationWarning)
    lmc_proto = pytest.importorskip("lmcache.v1.protocol")
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

SHAPE = torch.Size([2, 4, 256, 64])  # KV_2LTD: [2, layers, tokens, heads*head_dim]


class LMCacheClient:
    """LMCache's connector the way its storage manager drives it: a loop in a thread."""

    def __init__(self, port: int) -> None:
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=256,
            local_cpu=False,
            max_local_cpu_size=0.05,
            remote_url=f"lm://127.0.0.1:{port}",
        )
        meta = LMCacheMetadata(
            model_name="m",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.bfloat16,
            kv_shape=(4, 2, 256, 4, 16),
        )
        self.backend = LocalCPUBackend(config, meta)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.conn = LMCServerConnector("127.0.0.1", port, self.loop, self.backend)

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def close(self) -> None:
        self.run(self.conn.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


@pytest.fixture
def lmcache_server() -> Iterator[int]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port), "cpu"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_tcp("127.0.0.1", port, timeout=60)
        yield port
    finally:
        proc.kill()
        proc.wait()


def lm_key(h: int, session: str | None = None) -> CacheEngineKey:
    configs = {"lmcache.tag.s": session} if session else {}
    return CacheEngineKey("m", 1, 0, h, torch.bfloat16, configs)


def test_lmcache_connector_drives_our_sidecar(sidecar_process: SidecarFactory) -> None:
    sc = sidecar_process("--memory-bytes", str(64 << 20))
    lmc = LMCacheClient(sc.data_port)
    try:
        sent = lmc.backend.allocate(SHAPE, torch.bfloat16, MemoryFormat.KV_2LTD)
        assert sent is not None
        sent.tensor.copy_(torch.randn(sent.tensor.shape).to(torch.bfloat16))
        key = lm_key(0xABC, "sess-1")
        lmc.run(lmc.conn.put(key, sent))
        assert lmc.conn.exists_sync(key)
        got = lmc.run(lmc.conn.get(key))
        assert got is not None
        assert bytes(got.byte_array) == bytes(sent.byte_array)
        assert got.get_shape() == SHAPE
        assert got.get_dtype() == torch.bfloat16
        assert got.get_memory_format() == MemoryFormat.KV_2LTD
        assert lmc.run(lmc.conn.get(lm_key(0xDEF))) is None
        assert not lmc.conn.exists_sync(lm_key(0xDEF))
        # the block is bound to the session its tag names, and our client reads it too
        with KVClient("127.0.0.1", sc.data_port) as c:
            block = c.get(key.to_string())
            assert block is not None and bytes(block.data) == bytes(sent.byte_array)
            assert (block.fmt, block.dtype, block.shape) == (1, 3, tuple(SHAPE))
        info = httpx.get(f"{sc.url}/sessions/sess-1").json()
        assert info["blocks"] == 1 and info["bytes"] == len(sent.byte_array)
    finally:
        lmc.close()


def test_our_client_drives_lmcache_server(lmcache_server: int) -> None:
    data = os.urandom(2 * 4 * 256 * 64 * 2)
    key = lm_key(0x123, "sess-2").to_string()
    with KVClient("127.0.0.1", lmcache_server, timeout=30) as c:
        assert c.health()
        c.put(key, data, fmt=p.FMT_KV_2LTD, dtype=p.DTYPE_BFLOAT16, shape=tuple(SHAPE))
        assert c.exists(key)
        block = c.get(key)
        assert block is not None
        assert bytes(block.data) == data
        assert (block.fmt, block.dtype, block.shape) == (1, 3, tuple(SHAPE))
        assert c.get(lm_key(0x456).to_string()) is None
        assert not c.exists(lm_key(0x456).to_string())
        out = bytearray(len(data))
        into = c.get_into(key, out)
        assert into is not None and bytes(out) == data


def test_header_bytes_identical_to_lmcache() -> None:
    key = lm_key(0xFEED, "abc")
    for cmd, length, fmt, dtype, shape in [
        (lmc_proto.ClientCommand.PUT, 1 << 20, MemoryFormat.KV_2LTD, torch.bfloat16, SHAPE),
        (lmc_proto.ClientCommand.GET, 0, MemoryFormat(1), torch.float16, torch.Size([0] * 4)),
        (lmc_proto.ClientCommand.EXIST, 0, MemoryFormat(1), torch.float16, torch.Size([0] * 4)),
        (lmc_proto.ClientCommand.HEALTH, 0, MemoryFormat(1), torch.float16, torch.Size([0] * 4)),
    ]:
        theirs = lmc_proto.ClientMetaMessage(cmd, key, length, fmt, dtype, shape).serialize()
        ours = p.pack_request(
            int(cmd),
            key.to_string(),
            length=length,
            fmt=fmt.value,
            dtype=lmc_proto.DTYPE_TO_INT[dtype],
            shape=tuple(shape),
        )
        assert ours == theirs
        req = p.unpack_request(theirs)
        assert (req.command, req.key, req.length) == (int(cmd), key.to_string(), length)
    ok = lmc_proto.ServerMetaMessage.deserialize(
        p.pack_reply(200, length=5, fmt=1, dtype=3, shape=tuple(SHAPE))
    )
    assert (ok.code, ok.length, ok.dtype, ok.shape) == (200, 5, torch.bfloat16, SHAPE)
    miss = lmc_proto.ServerMetaMessage(
        lmc_proto.ServerReturnCode.FAIL,
        0,
        MemoryFormat(1),
        torch.float16,
        torch.Size((0, 0, 0, 0)),
    ).serialize()
    assert miss == p.REPLY_MISS
    assert lmc_proto.DTYPE_TO_INT[torch.bfloat16] == p.DTYPE_BFLOAT16
    assert lmc_proto.DTYPE_TO_INT[torch.float32] == p.DTYPE_FLOAT32
    assert lmc_proto.INT_TO_DTYPE[p.DTYPE_HALF] == torch.half
    assert MemoryFormat.KV_2LTD.value == p.FMT_KV_2LTD
