"""`ctxcache bench sidecar`: KV block PUT/GET over loopback, ours vs LMCache's server vs Redis.

For each target, block size and client count: every client thread first writes its own
keys (untimed), then times PUTs, then GETs, all threads released together. Throughput is
payload bytes over the phase's wall time; latencies are per operation. All targets run
in one invocation, one after the other, on this machine's loopback.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.sidecar.sidecar_report import Row
    from benchmarks.sidecar.sidecar_targets import Ops, Target

SIZES = (256 << 10, 4 << 20, 32 << 20)
CLIENTS = (1, 16)
TARGETS = ("ctxcache", "lmcache", "redis")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from benchmarks.lib.util import add_output_arguments

    a = parser.add_argument
    add_output_arguments(parser, "sidecar")
    a("--quick", action="store_true", help="a short run (fewer operations)")
    a("--targets", default=",".join(TARGETS), help=f"comma list of {', '.join(TARGETS)}")
    a("--sizes", default=",".join(str(s) for s in SIZES), help="block sizes in bytes")
    a("--clients", default=",".join(str(c) for c in CLIENTS), help="concurrent client counts")
    a(
        "--bytes-per-phase",
        type=int,
        help="payload bytes a timed phase moves over all rounds (default 1 GiB; 256 MiB --quick)",
    )
    a(
        "--leases",
        action="store_true",
        help="instead: the local path's lease + release round trip by key count "
        "(benchmarks/sidecar/sidecar_leases.py)",
    )
    a("--lease-keys", default="1,16,256,2048", help="(--leases) key counts per lease")
    a("--lease-rounds", type=int, default=7, help="(--leases) interleaved rounds")
    a("--against", help="(--leases) another checkout to time beside this one, e.g. a worktree")


def main(args: argparse.Namespace) -> int:
    if args.leases:
        from benchmarks.sidecar.sidecar_leases import run

        return run(args)
    import logging

    from tqdm import tqdm

    from benchmarks.lib.util import plot_path, run_meta
    from benchmarks.sidecar import sidecar_report as bench_report
    from benchmarks.sidecar.sidecar_targets import make_targets
    from ctxcache.logs import setup_logging

    setup_logging("bench", "WARNING")
    targets = [t for t in args.targets.split(",") if t]
    sizes = [int(s) for s in args.sizes.split(",")]
    clients = [int(c) for c in args.clients.split(",")]
    budget = args.bytes_per_phase or ((256 << 20) if args.quick else (1 << 30))
    min_ops = 1
    reps = 3 if args.quick else 7
    out = Path(args.out)
    meta = run_meta(
        "sidecar",
        targets=targets,
        sizes=sizes,
        clients=clients,
        bytes_per_phase=budget,
        rounds=reps,
        quick=args.quick,
    )
    out.mkdir(parents=True, exist_ok=True)
    working_set = max(clients) * max(sizes) * 2
    servers = make_targets(targets, out, memory_bytes=max(2 << 30, 2 * working_set))

    rows: list[bench_report.Row] = []
    started = []
    for server in servers:
        try:
            server.start()
            started.append(server)
        except Exception as exc:  # e.g. lmcache not installed: report it, run the rest
            logging.getLogger(__name__).error("could not start %s: %s", server.name, exc)
            server.stop()
    bar = tqdm(total=len(sizes) * len(clients) * reps * len(started), unit="round")
    try:
        for size in sizes:
            for n in clients:
                ops = max(min_ops, budget // (size * n * reps))
                bar.set_description(f"{bench_report.human(size)} x{n}")
                rows += _run_case(started, size, n, ops, reps, on_round=lambda: bar.update(1))
    finally:
        bar.close()
        for server in started:
            server.stop()
    done = [t for t in targets if any(r.target == t for r in rows)]
    meta["targets"] = done
    paths = bench_report.write(rows, done, out, meta, plot_path(args, "sidecar"))
    print(paths[1].read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _run_case(
    servers: list[Target], size: int, n: int, ops: int, reps: int, on_round: Callable[[], None]
) -> list[Row]:
    """One (size, clients) case on every server, interleaved: round r runs each server's
    PUT then GET phase, in an order rotated per round, so load from other processes on a
    shared machine falls on all servers alike. GB/s is the median over the rounds (one
    disturbed round does not decide a row); latency percentiles pool every operation."""
    from benchmarks.sidecar import sidecar_report as bench_report

    payload = os.urandom(size)
    keys_per_client = max(2, min(16, (64 << 20) // size))
    keys = [[f"bench@1@{c}@{k:x}@half" for k in range(keys_per_client)] for c in range(n)]
    clients = {s.name: [s.ops(size) for _ in range(n)] for s in servers}
    pooled: dict[tuple[str, str], tuple[list[float], list[float]]] = {}

    def put(o: Ops, k: str) -> object:
        o.put(k, payload)
        return None

    def get(o: Ops, k: str) -> object:
        return o.get(k)

    try:
        for name in clients:  # every key exists before anything is timed
            _phase(clients[name], keys, ops=keys_per_client, fn=put)
        for r in range(reps):
            for s in servers[r % len(servers) :] + servers[: r % len(servers)]:
                for op, fn in (("put", put), ("get", get)):
                    seconds, lat = _phase(clients[s.name], keys, ops=ops, fn=fn)
                    rates, lats = pooled.setdefault((s.name, op), ([], []))
                    rates.append(len(lat) * size / seconds / 1e9)
                    lats += lat
                on_round()
    finally:
        for group in clients.values():
            for c in group:
                c.close()
    rows = []
    for (name, op), (rates, lat) in pooled.items():
        lat.sort()
        gbps = statistics.median(rates)
        rows.append(
            bench_report.Row(
                target=name,
                op=op,
                size=size,
                clients=n,
                ops=len(lat),
                rounds=len(rates),
                gbps=round(gbps, 3),
                p50_ms=round(_pct(lat, 0.50) * 1e3, 3),
                p99_ms=round(_pct(lat, 0.99) * 1e3, 3),
                round_gbps=tuple(round(x, 3) for x in rates),
            )
        )
    return rows


def _phase(
    clients: list[Ops], keys: list[list[str]], *, ops: int, fn: Callable[[Ops, str], object]
) -> tuple[float, list[float]]:
    """Run `ops` operations on every client thread at once; (wall seconds, latencies)."""
    barrier = threading.Barrier(len(clients) + 1)
    lat: list[list[float]] = [[] for _ in clients]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        mine, ks = lat[i], keys[i]
        barrier.wait()
        try:
            for j in range(ops):
                t0 = time.perf_counter()
                fn(clients[i], ks[j % len(ks)])
                mine.append(time.perf_counter() - t0)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return seconds, [x for per in lat for x in per]


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
