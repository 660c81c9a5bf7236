"""`ctxcache bench sidecar --leases`: what a read lease of the local path costs, by key count.

A load over shared memory is a `lease` round trip for its keys (`sidecar.local_client`),
the copies, and a `release`. This times that control plane alone, against a real sidecar
with a local dir, for 1 to 2,048 keys (a vLLM step's loads share one lease; a Llama-3-8B
32k-token load at 16-token blocks is 2,048 keys):

- **round trip**: `lease`, then `release` waiting for its answer (two round trips);
- **deferred**: `lease`, then `release` trusted at once (`defer_releases`, as the vLLM
  connector runs): the release rides on the next lease (one round trip);
- **floor**: the same request line sent to a process that answers `{"ok":true}` at once
  from the same kind of thread: what the socket and two Python processes cost.

Sidecar and engine are two processes, as in production. `--against PATH` times another
checkout (e.g. a `git worktree` of HEAD) the same way, interleaved round by round with this
one, so a noisy machine disturbs both alike; the table gives each checkout's median and
the paired ratio. Each checkout runs its own sidecar *and* client: this file runs as a
script (`probe`) with only that checkout's `sidecar` package on the path, using the
`LocalClient` calls both have.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

KEYS = (1, 16, 256, 2048)
MODES = ("floor", "round trip", "deferred")
BLOCK = 4096  # bytes of each leased block (the control plane does not read them)
HEADER = (1001, 3, (32, 16, 1024, 2))  # fmt, dtype, shape: an engine-blocks header


def key(i: int) -> str:
    return f"bench/Llama-3-8B@1@0@{i:016x}@bfloat16@s%{'ab' * 16}"


def run(args: Any) -> int:
    """Time every mode and key count on this checkout (and `--against`), interleaved."""
    from tqdm import tqdm

    from benchmarks.lib.util import run_meta

    here = Path(__file__).resolve().parents[2]
    trees = {"this": here}
    if args.against:
        trees["against"] = Path(args.against).resolve()
    keys = [int(k) for k in args.lease_keys.split(",")]
    rounds = 3 if args.quick else args.lease_rounds
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for tree in trees.values():
        if not (tree / "sidecar" / "local_client.py").is_file():
            raise SystemExit(f"{tree} is not a checkout with sidecar/local_client.py")
    probes: dict[str, Probe] = {}
    times: dict[tuple[str, str, int], list[list[float]]] = {}
    bar = tqdm(total=rounds * len(keys) * len(trees), unit="case")
    try:
        for name, tree in trees.items():
            probes[name] = Probe(tree)
        for r in range(rounds):
            order = list(probes)[r % len(probes) :] + list(probes)[: r % len(probes)]
            for n in keys:
                reps = max(20, min(2000, 40_000 // n)) // (4 if args.quick else 1)
                for name in order:
                    for mode in MODES:
                        got = probes[name].ask(mode, n, reps)
                        times.setdefault((name, mode, n), []).append(got)
                    bar.update(1)
    finally:
        bar.close()
        for p in probes.values():
            p.close()
    rows = _rows(times, list(trees), keys)
    meta = run_meta("sidecar-leases", trees={k: str(v) for k, v in trees.items()}, rounds=rounds)
    (out / "sidecar_leases.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    table = _markdown(rows, list(trees))
    (out / "sidecar_leases.md").write_text(table)
    print(table)
    return 0


def _rows(
    times: dict[tuple[str, str, int], list[list[float]]], trees: list[str], keys: list[int]
) -> list[dict[str, Any]]:
    rows = []
    for n in keys:
        for mode in MODES:
            row: dict[str, Any] = {"keys": n, "mode": mode}
            for tree in trees:
                per_round = [statistics.median(t) * 1e6 for t in times[(tree, mode, n)]]
                row[f"{tree}_us"] = round(statistics.median(per_round), 1)
                row[f"{tree}_round_us"] = [round(x, 1) for x in per_round]
            if "against" in trees:
                pairs = zip(row["against_round_us"], row["this_round_us"], strict=True)
                row["speedup"] = round(statistics.median([a / b for a, b in pairs]), 2)
            rows.append(row)
    return rows


def _markdown(rows: list[dict[str, Any]], trees: list[str]) -> str:
    head = ["keys", "mode", *(f"{t} µs (median)" for t in trees)]
    if "against" in trees:
        head.append("against ÷ this, paired")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["keys"]), r["mode"], *(f"{r[f'{t}_us']:,.0f}" for t in trees)]
        if "against" in trees:
            cells.append(f"{r['speedup']:.2f}×")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


class Probe:
    """One checkout's sidecar, echo server and client, each a child process."""

    def __init__(self, tree: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="leasebench-", dir=_shm()))
        self.client: subprocess.Popen[str] | None = None
        self.server = self._start("serve", tree)
        assert self.server.stdout is not None
        if self.server.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError(f"the sidecar of {tree} did not start")
        self.client = self._start("client", tree)

    def _start(self, role: str, tree: Path) -> subprocess.Popen[str]:
        """This file as `role`'s probe, with only `tree` on the path (-P: not benchmarks/)."""
        return subprocess.Popen(
            [sys.executable, "-P", str(Path(__file__).resolve()), role, str(self.dir)],
            env={**os.environ, "PYTHONPATH": str(tree)},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def ask(self, mode: str, n: int, reps: int) -> list[float]:
        assert self.client is not None
        assert self.client.stdin is not None and self.client.stdout is not None
        self.client.stdin.write(json.dumps([mode, n, reps]) + "\n")
        self.client.stdin.flush()
        line = self.client.stdout.readline()
        if not line:
            raise RuntimeError(f"the lease probe in {self.dir} ended")
        return json.loads(line)

    def close(self) -> None:
        for p in (self.client, self.server):
            if p is None:
                continue
            if p.stdin is not None:
                p.stdin.close()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _shm() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


# ---- the probe: runs with only the checkout under test's `sidecar` on the path --------
def _serve(directory: Path) -> None:
    """A sidecar with a local dir, and beside it an echo socket (the floor); until stdin ends."""
    from sidecar.service import Sidecar
    from sidecar.settings import SidecarSettings

    sidecar = Sidecar(
        SidecarSettings(port=0, memory_bytes=64 << 20, local_dir=directory / "kv")
    ).start()
    echo = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    echo.bind(str(directory / "echo.sock"))
    echo.listen(8)
    threading.Thread(target=_echo, args=(echo,), daemon=True).start()
    print("ready", flush=True)
    sys.stdin.read()
    sidecar.stop()


def _echo(listener: socket.socket) -> None:
    while True:
        sock, _ = listener.accept()
        threading.Thread(target=_answer_all, args=(sock,), daemon=True).start()


def _answer_all(sock: socket.socket) -> None:
    reader = sock.makefile("rb")
    while reader.readline():
        sock.sendall(b'{"ok":true}\n')


def _client(directory: Path) -> None:
    """Store 2,048 blocks, then answer each `[mode, keys, reps]` on stdin with the
    seconds of each of `reps` loads."""
    from sidecar.local_client import LocalClient

    plain = LocalClient(directory / "kv")
    deferring = LocalClient(directory / "kv", defer_releases=True)
    keys = [key(i) for i in range(max(KEYS))]
    fmt, dtype, shape = HEADER
    for i in range(0, len(keys), 256):
        lease = plain.alloc([BLOCK] * 256)
        assert lease is not None
        assert plain.commit(lease, [(k, fmt, dtype, shape) for k in keys[i : i + 256]]) == 256
    echo = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    echo.connect(str(directory / "echo.sock"))
    echo_reader = echo.makefile("rb")
    for line in sys.stdin:
        mode, n, reps = json.loads(line)
        ks = keys[:n]
        request = (json.dumps({"op": "lease", "keys": ks}) + "\n").encode()
        c = deferring if mode == "deferred" else plain
        took = []
        for _ in range(max(3, reps // 10) + reps):  # (the first tenth: warm-up, untimed)
            t0 = time.perf_counter()
            if mode == "floor":
                echo.sendall(request)
                echo_reader.readline()
            elif not c.release(c.lease(ks)):
                raise RuntimeError("a lease did not hold")
            took.append(time.perf_counter() - t0)
        print(json.dumps(took[-reps:]), flush=True)
    plain.close()
    deferring.close()


if __name__ == "__main__":
    role, where = sys.argv[1], Path(sys.argv[2])
    _serve(where) if role == "serve" else _client(where)
