"""`ctxcache bench sidecar` end to end on a tiny workload: it runs and writes its outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ctxcache.cli",
            "bench",
            "sidecar",
            "--quick",
            "--out",
            str(out),
            "--targets",
            "ctxcache,redis",
            "--sizes",
            "4096,65536",
            "--clients",
            "1,3",
            "--bytes-per-phase",
            "262144",
        ],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((out / "results.json").read_text())["rows"]
    cases = {(r["target"], r["op"], r["size"], r["clients"]) for r in rows}
    assert len(cases) == 2 * 2 * 2 * 2
    assert all(r["gbps"] > 0 and r["p99_ms"] >= r["p50_ms"] > 0 for r in rows)
    table = (out / "results.md").read_text()
    assert "| GET | 64 KiB | 3 |" in table and "ctxcache GB/s" in table
    assert (out / "sidecar-bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
