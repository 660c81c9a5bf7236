"""`ctxcache bench gateway-keys`: wrong-key requests per second, many keys beside few, on a
tiny workload (50 and 5 keys, a second of load each): the output's shape, not its speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(180)
def test_bench_gateway_keys_measures_both_counts_and_prints_their_ratio(tmp_path: Path) -> None:
    argv = ["bench", "gateway-keys", "--keys", "50", "--few", "5", "--rounds", "2"]
    argv += ["--seconds", "1", "--connections", "4", "--out", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "ctxcache.cli", *argv],
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "gateway_keys.json").read_text())
    assert data["meta"]["benchmark"] == "gateway_keys"
    assert data["meta"]["keys"] == 50 and data["meta"]["few"] == 5
    results = data["results"]
    assert [s["keys"] for s in results["by_keys"]] == [50, 5]
    for s in results["by_keys"]:
        assert len(s["rounds_per_s"]) == 2 and all(x > 0 for x in s["rounds_per_s"])
        assert s["errors"] == 0 and s["refused"] == s["requests"] > 0  # every key refused
    assert results["ratio"] == pytest.approx(
        results["by_keys"][1]["per_s"] / results["by_keys"][0]["per_s"]
    )
    assert isinstance(results["met"], bool)
    table = proc.stdout
    assert table.startswith("| keys | wrong keys/s (median) |")
    assert "| 50 |" in table and "| 5 |" in table
    assert "5 keys / 50 keys: " in table and "target <= 1.2x" in table
    assert (tmp_path / "gateway_keys.md").read_text().endswith(table)
