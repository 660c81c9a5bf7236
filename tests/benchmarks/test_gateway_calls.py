"""`ctxcache bench gateway-calls`: function calls per session turn in the gateway, this
checkout beside another (here: itself). The output's shape, and that a turn's calls are
counted at all (a session turn runs a few thousand Python calls; the gateway's own, a few
hundred)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import check_png

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a benchmark run end to end (docs/testing.md)
@pytest.mark.timeout(180)
def test_bench_gateway_calls_counts_both_kinds_beside_another_checkout(tmp_path: Path) -> None:
    argv = ["bench", "gateway-calls", "--quick", "--against", str(ROOT), "--out", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "ctxcache.cli", *argv],
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "gateway-calls.json").read_text())
    rows = {row["kind"]: row for row in data["results"]}
    assert set(rows) == {"completion", "chat"}
    for row in rows.values():
        assert 1000 < row["this_calls"] < 50_000 and 50 < row["this_gateway"] < row["this_calls"]
        # the same code on both sides: the same cost, up to the timers' calls
        assert 0.8 < row["this_calls"] / row["against_calls"] < 1.25
    assert (tmp_path / "gateway-calls.md").read_text().startswith("`ctxcache bench gateway-calls")
    check_png(tmp_path / "gateway-calls.png")
