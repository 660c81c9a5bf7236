"""Part 2 of `ctxcache bench sessions`: the sidecar's pin policies on a node whose idle
pinned KV grows from 1x to 10x its memory tier.

The sidecar alone (a real `ctxcache sidecar` process per case, memory + disk tiers), driven
the way the manager and an engine drive it: pins over the control API, KV blocks over lm://.
Per scale and policy (`lru`, `reserve`), in one run:

1. `--kv-active` active sessions are pinned and store their context (4 blocks each);
2. the idle mass arrives — sessions pinned for an hour, `scale x memory tier` bytes of KV in
   all, in 5 waves, each followed by one turn of every active session (they keep working
   while the node fills up);
3. 5 measured rounds: each active session's turn looks up its chain of blocks in order
   with GET until the first miss (a prefix: what follows a miss is of no use to an engine),
   stores what it missed (the recompute) and one new block (the turn's new chunk).

Hit rate = blocks found / blocks looked up in step 3. The idle sessions are never read again.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import httpx

log = logging.getLogger("ctxcache.bench.sessions")

BLOCK_KIB = 64
BLOCKS_PER_SESSION = 4
WAVES = 5
ROUNDS = 5


def add_kv_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-scales", default=None, help="idle KV / memory tier (default 1,2,4,6,8,10)")
    p.add_argument("--kv-memory-mib", type=int, default=0, help="memory tier (16; quick 4)")
    p.add_argument("--kv-disk-mib", type=int, default=0, help="disk tier (32; quick 8)")
    p.add_argument("--kv-active", type=int, default=0, help="active sessions (24; quick 6)")


def kv_policies(args: argparse.Namespace, logs: IO[str]) -> list[dict[str, Any]]:
    from tqdm import tqdm

    scales = [
        float(s) for s in (args.kv_scales or ("1,4" if args.quick else "1,2,4,6,8,10")).split(",")
    ]
    memory = (args.kv_memory_mib or (4 if args.quick else 16)) << 20
    disk = (args.kv_disk_mib or (8 if args.quick else 32)) << 20
    active = args.kv_active or (6 if args.quick else 24)
    rows = []
    cases = [(scale, policy) for scale in scales for policy in ("lru", "reserve")]
    with (
        tempfile.TemporaryDirectory() as tmp,
        tqdm(total=len(cases), desc="pin policies", unit="case", disable=args.no_progress) as bar,
    ):
        for scale, policy in cases:
            data_dir = Path(tmp) / f"{policy}-{scale}"
            rows.append(one_case(scale, policy, memory, disk, active, data_dir, logs))
            log.info("pin policy %s at %.0fx: %s", policy, scale, rows[-1])
            bar.update(1)
    return rows


def one_case(
    scale: float, policy: str, memory: int, disk: int, active: int, data_dir: Path, logs: IO[str]
) -> dict[str, Any]:
    from benchmarks.lib.stack import sidecar_service
    from benchmarks.sessions.sessions import metric
    from ctxcache.supervisor import Supervisor
    from sidecar.client import KVClient
    from sidecar.protocol import DTYPE_BFLOAT16, FMT_KV_2LTD

    block = BLOCK_KIB << 10
    payload = os.urandom(block)
    shape = (2, 1, block // 4, 1)
    idle = round(scale * memory / (block * BLOCKS_PER_SESSION))
    sidecar, data_port = sidecar_service(
        args=[
            *("--memory-bytes", str(memory), "--disk-bytes", str(disk)),
            *("--data-dir", str(data_dir), "--pin-policy", policy),
            *("--log-level", "ERROR"),  # a warning per refused block: counted in /metrics instead
        ]
    )
    control = sidecar.url
    chains: dict[str, int] = {}  # active session -> blocks in its chain
    looked = found = 0
    t0 = time.perf_counter()
    with (
        Supervisor(out=logs) as sup,
        httpx.Client(base_url=control, timeout=30) as http,
    ):
        sup.start(sidecar.child())
        with KVClient("127.0.0.1", data_port, timeout=30) as kv:

            def key(session: str, i: int) -> str:
                return f"bench@1@0@{i:x}@bfloat16@s%{session}"

            def new_session(session: str) -> None:
                http.put(f"/sessions/{session}", json={"expires_at": time.time() + 3600})
                for i in range(BLOCKS_PER_SESSION):
                    kv.put(
                        key(session, i), payload, fmt=FMT_KV_2LTD, dtype=DTYPE_BFLOAT16, shape=shape
                    )

            def turn(session: str) -> tuple[int, int]:
                n = chains[session]
                hits = 0
                while hits < n and kv.get(key(session, hits)) is not None:
                    hits += 1
                for i in range(hits, n + 1):  # the recompute, then the new chunk
                    kv.put(
                        key(session, i), payload, fmt=FMT_KV_2LTD, dtype=DTYPE_BFLOAT16, shape=shape
                    )
                chains[session] = n + 1
                return n, hits

            for a in range(active):
                new_session(f"active{a}")
                chains[f"active{a}"] = BLOCKS_PER_SESSION
            made = 0
            for wave in range(1, WAVES + 1):
                while made < idle * wave // WAVES:
                    new_session(f"idle{made}")
                    made += 1
                for session in list(chains):
                    turn(session)
            for _ in range(ROUNDS):
                for session in list(chains):
                    n, hits = turn(session)
                    looked += n
                    found += hits
        stats = http.get("/stats").json()
        text = http.get("/metrics").text
    return {
        "scale": scale,
        "policy": policy,
        "idle_sessions": idle,
        "idle_mib": round(idle * BLOCKS_PER_SESSION * block / 2**20, 1),
        "active_sessions": active,
        "memory_mib": memory >> 20,
        "disk_mib": disk >> 20,
        "looked_up": looked,
        "found": found,
        "hit_rate": round(found / looked, 4) if looked else None,
        "pinned_dropped_sessions": int(
            metric(text, "ctxcache_sidecar_pinned_dropped_sessions_total")
        ),
        "pinned_dropped_blocks": int(metric(text, "ctxcache_sidecar_pinned_dropped_blocks_total")),
        "refused_blocks": int(metric(text, "ctxcache_sidecar_refused_blocks_total")),
        "memory_bytes_used": stats["memory_bytes_used"],
        "disk_bytes_used": stats["disk_bytes_used"],
        "pinned_bytes": stats["pinned_bytes"],
        "seconds": round(time.perf_counter() - t0, 1),
    }
