"""`ctxcache bench gateway-keys`: wrong-key requests per second, many keys beside few, on a
tiny workload (50 and 5 keys, a second of load each): the output's shape, not its speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import check_png


@pytest.mark.slow  # a benchmark run end to end (docs/testing.md)
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
    assert data["meta"]["target_ratio"] == 1.2
    many, few = data["results"]
    assert (many["keys"], few["keys"]) == (50, 5)
    for s in (many, few):
        assert len(s["rounds_per_s"]) == 2 and all(x > 0 for x in s["rounds_per_s"])
        assert s["errors"] == 0 and s["refused"] == s["requests"] > 0  # every key refused
    assert many["vs_many"] == 1.0
    assert few["vs_many"] == pytest.approx(few["per_s"] / many["per_s"])
    table = proc.stdout
    assert table.startswith("| keys | wrong keys/s (median) |")
    assert "| 50 |" in table and "| 5 |" in table
    assert "5 keys / 50 keys: " in table and "target <= 1.2x" in table
    assert (tmp_path / "gateway_keys.md").read_text().endswith(table)
    check_png(tmp_path / "gateway_keys.png")
