"""Write leases that nothing frees, and keys counted in bytes (issue 56, item 2).

Each test spells out the hostile sequence and names the rule it checks (docs/sidecar.md,
"Invariants of the local path", 2 and 5):
- a refusal keeps the lease: a commit refused as a bad request changes nothing on the
  sidecar, and the client aborts the lease it left open;
- a client that closed cleanly is provably gone: its lock file is removed, and the sidecar
  frees every lease it held;
- a key is at most 150 bytes on both sides: a tag that cannot fit is refused where the
  request enters (the connector's scheduler side), never at commit.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ctxcache.lmcache_keys import CacheKey
from sidecar.client import KVClient
from sidecar.local_client import LocalClient
from sidecar.local_protocol import MAX_LEASES
from sidecar.protocol import DTYPE_BFLOAT16, FMT_KV_2LTD
from sidecar.service import Sidecar
from tests.sidecar.helpers import SHAPE, put_tcp
from tests.sidecar.helpers import start_local as start
from tests.sidecar.test_local_leases import get_local, raw, region_offset
from tests.utils import local_dir_fixture  # noqa: F401 (the local_dir fixture)
from vllm_connector.config import ConnectorConfig
from vllm_connector.plan import Planner
from vllm_connector.scheduler import SchedulerSide
from worker.kv.hashing import KeyMaker

BLOCK = 64 << 10


def key(i: int, tag: str = "sess") -> str:
    return f"m@1@0@{i}@bfloat16@s%{tag}"


def _wait(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# ---- a refusal keeps the lease, and the client ends it ----------------------------------
def test_commits_refused_for_a_key_over_150_bytes_leave_no_lease_behind(local_dir: Path) -> None:
    """Sequence: an engine's session tag is non-ASCII, its keys 89 characters but 159
    bytes; the sidecar refuses each commit as a bad request (the key field holds 150
    bytes). Before, each refusal kept its write lease open and nothing ever ended it: after
    256 of them the client held its cap of leases, and every later `alloc` and `lease` of
    that engine was refused until a restart. Now the client aborts what was refused."""
    long_key = key(7, "é" * 70)
    assert len(long_key) <= 150 < len(long_key.encode())
    sc = start(local_dir, memory=8 << 20)  # (room for more than 256 slots in one share)
    engine = LocalClient(local_dir)
    try:
        assert sc.local is not None
        put_tcp(sc, key(1), b"\x01" * 4096)
        for _ in range(MAX_LEASES + 44):
            lease = engine.alloc([4096])
            assert lease is not None
            assert engine.commit(lease, [(long_key, FMT_KV_2LTD, DTYPE_BFLOAT16, SHAPE)]) == 0
        assert sc.local.leases == 0 and not sc.store.exists(long_key)
        assert get_local(engine, key(1)) == b"\x01" * 4096  # its loads still lease
    finally:
        engine.close()
        sc.stop()


def test_a_commit_with_the_wrong_number_of_blocks_is_refused_and_keeps_its_lease(
    local: Sidecar, local_dir: Path
) -> None:
    """The one rule, on the wire: a commit refused as a bad request changes nothing, so
    its writer can commit again (before, this refusal alone freed the slots while the
    writer still held them, and the next commit found no lease)."""
    assert local.local is not None
    block = {"key": key(1), "fmt": FMT_KV_2LTD, "dtype": DTYPE_BFLOAT16, "shape": list(SHAPE)}
    with raw(local_dir, hello=True) as ask:
        got = ask({"op": "alloc", "lengths": [4096]})
        assert got["ok"]
        reply = ask({"op": "commit", "lease": got["lease"], "blocks": [block, block]})
        assert reply["ok"] is False and str(reply["error"]).startswith("bad request")
        assert local.local.leases == 1  # still the writer's
        assert ask({"op": "commit", "lease": got["lease"], "blocks": [block]})["stored"] == 1
    assert local.local.leases == 0 and local.store.exists(key(1))


# ---- a clean close is provably gone -------------------------------------------------------
def test_a_client_that_closes_with_open_write_leases_gives_their_slots_back(
    local: Sidecar, local_dir: Path
) -> None:
    """Sequence: an engine allocates three write slots and closes its client without
    committing or aborting (it stopped writing). Before, `close` removed its lock file, so
    the sidecar could no longer tell that it was gone: its leases and slots stayed for the
    sidecar's whole life, past any `expire`. Now a lock file that is gone is a client that
    is gone."""
    assert local.local is not None and local.arena is not None
    gc.collect()
    idle = local.arena.used
    writer = LocalClient(local_dir)
    leases = [writer.alloc([BLOCK]) for _ in range(3)]
    assert all(lease is not None for lease in leases) and local.local.leases == 3
    writer.close()
    assert not (local_dir / f"client-{writer.token}.lock").exists()
    _wait(lambda: local.local is not None and (local.local.expire(), local.local.leases)[1] == 0)
    local.local.expire(now=float("inf"))
    gc.collect()
    assert local.arena.used == idle
    first = leases[0]
    assert first is not None
    put_tcp(local, key(1), b"\x01" * BLOCK)  # first fit: the first slot it had is free again
    assert region_offset(local, key(1)) == first.slots[0].offset


def test_a_client_whose_writes_may_still_land_keeps_its_slots_past_its_close(
    local: Sidecar, local_dir: Path
) -> None:
    """The exception a writer must ask for: one that cannot tell whether a copy still
    writes into its slot (`keep_until_exit`) keeps its lock file held past `close`, so
    the slot stays its own until its process ends (here: its lock let go, as the kernel
    does at exit)."""
    assert local.local is not None
    writer = LocalClient(local_dir)
    lease = writer.alloc([BLOCK])
    assert lease is not None
    writer.keep_until_exit(lease)
    writer.close()
    time.sleep(0.2)
    local.local.expire(now=float("inf"))
    assert local.local.leases == 1
    put_tcp(local, key(1), b"\x01" * BLOCK)
    assert region_offset(local, key(1)) != lease.slots[0].offset
    os.close(writer._lock_fd)  # what the kernel does when the process ends
    _wait(lambda: local.local is not None and (local.local.expire(), local.local.leases)[1] == 0)


def test_a_lock_file_the_sidecar_cannot_open_is_not_taken_for_a_close(
    local: Sidecar, local_dir: Path
) -> None:
    """The other side of that rule: only a lock file that is not there says the client
    closed. One there that the sidecar cannot open (here: replaced by a directory) says
    nothing, and the writer's lease stays."""
    assert local.local is not None
    writer = LocalClient(local_dir)
    try:
        assert writer.alloc([BLOCK]) is not None
        lock = local_dir / f"client-{writer.token}.lock"
        lock.unlink()
        lock.mkdir()  # (not a regular file: `client_alive` cannot tell)
        writer._disconnect()
        time.sleep(0.2)
        local.local.expire(now=time.monotonic() + 3600)
        assert local.local.leases == 1
        lock.rmdir()
    finally:
        writer.close()


# ---- keys in bytes, refused where the request enters --------------------------------------
@dataclass
class Request:
    """The fields the connector's scheduler side reads of vLLM's `Request`."""

    request_id: str
    all_token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None = field(default_factory=dict)
    cache_salt: str | None = None
    num_computed_tokens: int = 0
    num_in_flight_tokens: int = 0
    trace_headers: dict[str, str] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def test_a_tag_whose_characters_fit_but_bytes_do_not_is_refused_by_the_scheduler_side(
    local: Sidecar,
) -> None:
    """Sequence: a request tagged with a non-ASCII session whose key is 150 characters
    but more than 150 bytes. Before, the key maker counted characters: the scheduler side
    planned its store, and the sidecar refused every commit of it. Now the key maker counts
    bytes as the sidecar does, and the scheduler side leaves the request alone: no lookup,
    no store (vLLM computes and serves it as without a cache)."""
    keys = KeyMaker("tiny", "bfloat16", 0)
    room = 150 - len(keys.key((1 << 128) - 1, (("s", ""),)))
    ascii_tag, wide_tag = (("s", "a" * room),), (("s", "é" * room),)
    wide_key = CacheKey("tiny", 1, 0, (1 << 128) - 1, "bfloat16", wide_tag).to_string()
    assert len(wide_key) == 150 < len(wide_key.encode())
    assert keys.fits(ascii_tag) and not keys.fits(wide_tag)
    with pytest.raises(ValueError, match="150 bytes"):
        keys.key(1, wide_tag)
    asked: list[KVClient] = []

    def make_client() -> KVClient:
        asked.append(KVClient("127.0.0.1", local.port))
        return asked[-1]

    config = ConnectorConfig(sidecar_url=f"lm://127.0.0.1:{local.port}")
    side = SchedulerSide(config, Planner(keys, 256, 16), make_client)  # type: ignore[arg-type]
    try:
        ids = list(range(4, 604))
        wide = Request("wide", ids, {"lmcache.tag.s": wide_tag[0][1]}, num_computed_tokens=599)
        assert side.matched_tokens(wide, 0) == 0
        assert side.finished(wide, list(range(40))) is False  # no store planned
        assert not asked  # the sidecar was not even asked
        fits = Request("fits", ids, {"lmcache.tag.s": ascii_tag[0][1]}, num_computed_tokens=599)
        side.matched_tokens(fits, 0)
        assert side.finished(fits, list(range(40))) is True  # the same length in ASCII: stored
        assert [s.req_id for s in side.build(None).stores] == ["fits"]
    finally:
        side.close()
