"""`ctxcache bench sidecar --leases`: the local path's lease round trip, by key count,
this checkout beside another (here: itself)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(180)
def test_bench_sidecar_leases_times_each_mode_and_key_count_beside_another_checkout(
    tmp_path: Path,
) -> None:
    argv = ["bench", "sidecar", "--leases", "--quick", "--lease-keys", "1,64"]
    argv += ["--against", str(ROOT), "--out", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "ctxcache.cli", *argv],
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "sidecar_leases.json").read_text())
    rows = data["results"]
    assert {(r["keys"], r["mode"]) for r in rows} == {
        (n, mode) for n in (1, 64) for mode in ("floor", "round trip", "deferred")
    }
    for r in rows:
        assert r["this_us"] > 0 and r["against_us"] > 0 and len(r["this_round_us"]) == 3
        assert r["speedup"] > 0
    by = {(r["keys"], r["mode"]): r for r in rows}
    # a lease and its release: two round trips of the sidecar, more than one of the floor
    assert by[(64, "round trip")]["this_us"] > by[(64, "floor")]["this_us"]
    table = (tmp_path / "sidecar_leases.md").read_text()
    assert "| 64 | deferred |" in table and "against ÷ this, paired" in table
