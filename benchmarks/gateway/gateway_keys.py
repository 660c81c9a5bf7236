"""`ctxcache bench gateway-keys`: how many wrong API keys one gateway refuses per second with
100,000 keys configured, beside the same gateway with 10 (issue 56, item 3).

A client that sprays wrong keys must not cost the gateway more because it has many keys:
each wrong key is looked up by its digest, as a right one is (`gateway/auth.py`); it used to
be compared with every key's digest, 10-30 ms of the event loop per guess at 100,000 keys,
every tenant's requests stalled behind it.

One real gateway process (`ctxcache gateway --api-keys-file`, its in-process manager's
Redis URL a port where nothing listens: a refused key never reaches a store) answers
`GET /v1/models` with a new wrong key on every request (`Authorization: Bearer
sk-wrong-<n>`: 401 `invalid_api_key`), as fast as a load generator sends them: `wrk` where
it is installed (one thread, keep-alive connections, a Lua script that makes the keys),
else a keep-alive generator of our own. Between rounds the keys file is swapped (many keys,
few keys, alternating, the order flipped every round so drift falls on both) and the
gateway told with SIGHUP; a probe key that only the new file holds says when it took it.

The table (and `gateway_keys.json`, a row per count; `gateway_keys.png`): wrong-key requests
per second with each count (the median of the rounds, every round listed), p50/p99 latency
(wrk only), and the ratio few/many (`vs_many`). Acceptance: the ratio is at most 1.2.
`--gateway-tree PATH` runs the gateway from another checkout (its `PYTHONPATH`), the
driver from this one: the same bench against older code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.lib.process import Process

NAME = "gateway_keys"
PATH = "/v1/models"  # a route that checks a presented key and needs nothing else
TARGET = 1.2  # the few keys' rate over the many's, at most
_WRK_SCRIPT = """
local n = 0
request = function()
  n = n + 1
  return wrk.format("GET", "PATH", {["Authorization"] = "Bearer sk-wrong-" .. n})
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_JSON {"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, '
      .. '"socket_errors": %d, "status_errors": %d}\\n',
    summary.requests, summary.duration, latency:percentile(50),
    latency:percentile(99), e.connect + e.read + e.write + e.timeout, e.status))
end
""".replace("PATH", PATH)


@dataclass
class Round:
    keys: int
    requests: int
    seconds: float
    refused: int  # answers that were 401 (wrk: every non-2xx/3xx answer)
    errors: int  # socket errors, timeouts, answers other than 401
    p50_ms: float | None = None
    p99_ms: float | None = None

    @property
    def per_s(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from benchmarks.lib.util import add_output_arguments

    a = parser.add_argument
    a("--keys", type=int, default=100_000, help="the many keys' count (default 100000)")
    a("--few", type=int, default=10, help="the few keys' count (default 10)")
    a("--rounds", type=int, default=None, help="rounds, each loading both counts (default 3)")
    a("--seconds", type=float, default=None, help="load per count per round (default 5)")
    a("--quick", action="store_true", help="a short run (1 round of 1 s per count)")
    a("--connections", type=int, default=16, help="keep-alive connections (default 16)")
    a("--no-wrk", action="store_true", help="use our own load generator even if wrk is here")
    a(
        "--gateway-tree",
        type=Path,
        default=None,
        help="run the gateway from this checkout (on its PYTHONPATH); the driver is this one",
    )
    add_output_arguments(parser, NAME)


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from benchmarks.lib.util import bar_plot, markdown_table, plot_path, run_meta, write_outputs
    from ctxcache.net import free_port

    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.seconds is None:
        args.seconds = 1.0 if args.quick else 5.0
    wrk = None if args.no_wrk else _which("wrk")
    counts = [args.keys, args.few]
    with tempfile.TemporaryDirectory() as tmp:
        files = {n: _keys_file(Path(tmp), n) for n in counts}
        live = Path(tmp) / "keys.json"
        _install(files[args.keys], live)
        gateway = _start_gateway(free_port(), live, free_port(), args.gateway_tree, Path(tmp))
        try:
            _wait_ready(gateway.spawn(), f"sk-probe-{args.keys}")
            rounds: list[Round] = []
            plan = [(r, n) for r in range(args.rounds) for n in (counts[:: 1 - 2 * (r % 2)])]
            with tqdm(total=len(plan), desc="gateway-keys", unit="load") as bar:
                for r, n in plan:
                    _swap(gateway, files[n], live, f"sk-probe-{n}")
                    got = asyncio.run(_load(gateway.port, wrk, args.connections, args.seconds))
                    got.keys = n
                    rounds.append(got)
                    bar.set_postfix_str(f"round {r + 1}, {n} keys: {got.per_s:,.0f}/s")
                    bar.update()
        finally:
            gateway.stop()
    results = _summarise(rounds, counts)
    meta = run_meta(
        NAME,
        keys=args.keys,
        few=args.few,
        rounds=args.rounds,
        seconds=args.seconds,
        connections=args.connections,
        generator="wrk" if wrk else "python",
        gateway_tree=str(args.gateway_tree) if args.gateway_tree else None,
        target_ratio=TARGET,
    )
    rows = [
        [
            s["keys"],
            s["per_s"],
            " / ".join(f"{x:,.0f}" for x in s["rounds_per_s"]),
            "-" if s["p50_ms"] is None else s["p50_ms"],
            "-" if s["p99_ms"] is None else s["p99_ms"],
            s["errors"],
        ]
        for s in results
    ]
    table = markdown_table(
        ["keys", "wrong keys/s (median)", "each round", "p50 ms", "p99 ms", "errors"], rows
    )
    ratio = results[1]["vs_many"]
    verdict = "met" if ratio <= TARGET else "NOT met"
    table += (
        f"\n\n{args.few} keys / {args.keys} keys: {ratio:.2f}x (target <= {TARGET}x: {verdict})\n"
    )
    write_outputs(Path(args.out), NAME, {"meta": meta, "results": results}, table)
    bar_plot(
        plot_path(args, NAME),
        "wrong API keys refused per second, one gateway",
        [f"{s['keys']:,} keys" for s in results],
        {"median of the rounds": [s["per_s"] for s in results]},
        "requests/s",
    )
    sys.stdout.write(table)
    return 0 if all(r.errors == 0 for r in rounds) else 1


def _summarise(rounds: list[Round], counts: list[int]) -> list[dict[str, Any]]:
    """A row per count (the many first); `vs_many`: its rate over the many keys' rate."""
    by_keys = []
    for n in counts:
        mine = [r for r in rounds if r.keys == n]
        p50 = [r.p50_ms for r in mine if r.p50_ms is not None]
        p99 = [r.p99_ms for r in mine if r.p99_ms is not None]
        by_keys.append(
            {
                "keys": n,
                "per_s": statistics.median(r.per_s for r in mine),
                "rounds_per_s": [r.per_s for r in mine],
                "requests": sum(r.requests for r in mine),
                "refused": sum(r.refused for r in mine),
                "errors": sum(r.errors for r in mine),
                "p50_ms": statistics.median(p50) if p50 else None,
                "p99_ms": statistics.median(p99) if p99 else None,
            }
        )
    many = by_keys[0]["per_s"]
    for row in by_keys:
        row["vs_many"] = row["per_s"] / many if many else float("inf")
    return by_keys


# ---- the gateway --------------------------------------------------------------------------
def _keys_file(tmp: Path, n: int) -> Path:
    """A keys file of `n` keys (one of them `sk-probe-<n>`, which says this file is in)."""
    keys = {f"sk-bench-{n}-{i:07d}": f"t{i % 100}" for i in range(n - 1)}
    keys[f"sk-probe-{n}"] = "probe"
    path = tmp / f"keys-{n}.json"
    path.write_text(json.dumps(keys))
    path.chmod(0o600)
    return path


def _install(src: Path, live: Path) -> None:
    """`src` becomes the gateway's keys file at once (a rename over it)."""
    tmp = live.with_suffix(".new")
    tmp.write_bytes(src.read_bytes())
    tmp.chmod(0o600)
    os.replace(tmp, live)


def _start_gateway(port: int, keys: Path, dead_port: int, tree: Path | None, tmp: Path) -> Process:
    """`ctxcache gateway` (from `tree` if set) with the keys file `keys`, reloaded on SIGHUP
    only, its store a Redis URL where nothing listens; ready once `keys`' probe answers."""
    from benchmarks.lib.stack import Gateway, gateway_service

    env = {"CTX_GATEWAY_API_KEYS_FILE_POLL_S": "0"}  # SIGHUP only
    gateway = Gateway(args=("--api-keys-file", str(keys)), env=env, tree=tree)
    store = ["--redis-url", f"redis://127.0.0.1:{dead_port}/0"]  # nothing there: no store
    return gateway_service(gateway, port, store, []).process(tmp / "gateway.log")


def _status(port: int, key: str) -> int | None:
    import httpx

    try:
        r = httpx.get(
            f"http://127.0.0.1:{port}{PATH}", headers={"Authorization": f"Bearer {key}"}, timeout=5
        )
    except httpx.HTTPError:
        return None
    return r.status_code


def _wait_ready(gateway: Process, probe: str) -> None:
    """Until the gateway takes `probe` (its keys file is in), 120 s at most; then a wrong
    key must be refused with 401."""
    from benchmarks.lib.process import wait_ready

    def took(timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while _status(gateway.port, probe) != 200:
            if time.monotonic() > deadline:
                raise TimeoutError(probe)
            time.sleep(0.2)

    assert gateway.proc is not None
    wait_ready(took, gateway.proc.poll, timeout=120, what="the gateway (taking its keys)")
    if _status(gateway.port, "sk-wrong-0") != 401:
        raise RuntimeError("a wrong key is not refused with 401")


def _swap(gateway: Process, src: Path, live: Path, probe: str) -> None:
    """The keys of `src` in the gateway (a SIGHUP; its probe key answered), then a pause for
    the old keys to be freed (in a thread of the gateway)."""
    if _status(gateway.port, probe) == 200:
        return  # (already in)
    _install(src, live)
    gateway.send_signal(signal.SIGHUP)
    _wait_ready(gateway, probe)
    time.sleep(1.0)


# ---- the load -------------------------------------------------------------------------------
def _which(name: str) -> str | None:
    import shutil

    return shutil.which(name)


async def _load(port: int, wrk: str | None, connections: int, seconds: float) -> Round:
    if wrk is not None:
        return await _load_wrk(port, wrk, connections, seconds)
    return await _load_python(port, connections, seconds)


async def _load_wrk(port: int, wrk: str, connections: int, seconds: float) -> Round:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "wrong.lua"
        script.write_text(_WRK_SCRIPT)
        proc = await asyncio.create_subprocess_exec(
            *(wrk, "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s"),
            *("--timeout", "30s", "-s", str(script), f"http://127.0.0.1:{port}{PATH}"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"wrk exited with {proc.returncode}: {err.decode()[-500:]}")
    line = next((x for x in out.decode().splitlines() if x.startswith("WRK_JSON ")), None)
    if line is None:
        raise RuntimeError(f"no result line in wrk's output: {out.decode()[-500:]!r}")
    d = json.loads(line.removeprefix("WRK_JSON "))
    refused = d["status_errors"]  # every answer was refused, or it is an error below
    return Round(
        keys=0,
        requests=d["requests"],
        seconds=d["duration_us"] / 1e6,
        refused=refused,
        errors=d["socket_errors"] + d["requests"] - refused,
        p50_ms=d["p50_us"] / 1e3,
        p99_ms=d["p99_us"] / 1e3,
    )


async def _load_python(port: int, connections: int, seconds: float) -> Round:
    """`connections` keep-alive connections sending wrong keys until `seconds` are up."""
    got = Round(keys=0, requests=0, seconds=0.0, refused=0, errors=0)
    counter = iter(range(1 << 62))

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while time.perf_counter() < end:
                req = f"GET {PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                req += f"Authorization: Bearer sk-wrong-{next(counter)}\r\n\r\n"
                writer.write(req.encode())
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                got.requests += 1
                if head[9:12] == b"401":
                    got.refused += 1
                else:
                    got.errors += 1
        except (OSError, asyncio.IncompleteReadError):
            got.errors += 1
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    start = time.perf_counter()
    end = start + seconds
    await asyncio.gather(*(client() for _ in range(connections)))
    got.seconds = time.perf_counter() - start
    return got
