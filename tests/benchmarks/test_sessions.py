"""`ctxcache bench sessions --quick`: a real stack (Redis, sidecar, the fake engine storing
made-up KV in the sidecar, a gateway) grown to a few hundred and a thousand live sessions,
then the sidecar's two pin policies on a node full of idle sessions. The full-size run is
in docs/benchmarks.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.utils import check_png


@pytest.mark.slow  # a benchmark's run end to end, 10-20 s: make test-slow (docs/testing.md)
@pytest.mark.timeout(300)
def test_bench_sessions_quick(tmp_path: Path) -> None:
    argv = ["bench", "sessions", "--quick", "--no-progress", "--out", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "ctxcache.cli", *argv],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "sessions.json").read_text())
    rows = data["results"]
    assert [r["size"] for r in rows] == [300, 1000]
    for r in rows:
        assert r["errors"] == {}
        # the idle mass is real: the live count reached the size
        assert r["size"] <= r["live_sessions"] <= r["size"] * 1.3
        for op in ("create", "turn", "get", "list"):
            assert r[f"{op}_n"] > 0 and 0 < r[f"{op}_p50_ms"] <= r[f"{op}_p99_ms"], op
        # a session costs kilobytes in Redis, its keys most of it
        assert 1_000 < r["redis_session_keys_bytes"] < r["redis_bytes_per_session"] < 20_000
        # the fake engine found the active sessions' KV in the sidecar
        assert r["hit_rate"] is not None and r["hit_rate"] > 0.9
        assert r["sidecar_memory_bytes_per_session"] > 0
        assert {"gateway", "sidecar", "worker", "redis"} == set(r["rss_mib"])
        assert all(v > 0 for v in r["rss_mib"].values())
        assert set(r["cpu_ms_per_op"]) == set(r["rss_mib"])
        assert r["cpu_ms_per_op"]["gateway"] > 0 and r["redis_usec_per_script"] > 0
    kv = {(r["scale"], r["policy"]): r for r in data["kv_results"]}
    assert set(kv) == {(1.0, "lru"), (1.0, "reserve"), (4.0, "lru"), (4.0, "reserve")}
    # at 4x the memory tier, the lru policy keeps the active sessions hot, dropping idle
    # ones; first come, first served refuses their new blocks
    assert kv[4.0, "lru"]["hit_rate"] >= 0.9
    assert kv[4.0, "lru"]["pinned_dropped_sessions"] > 0
    assert kv[4.0, "lru"]["refused_blocks"] == 0
    assert kv[4.0, "reserve"]["hit_rate"] < kv[4.0, "lru"]["hit_rate"]
    assert kv[4.0, "reserve"]["refused_blocks"] > 0
    table = (tmp_path / "sessions.md").read_text()
    assert table.startswith("`ctxcache bench sessions --quick")
    assert "| active hit rate, lru |" in table
    check_png(tmp_path / "sessions.png")
    check_png(tmp_path / "sessions-kv.png")


@pytest.mark.slow  # a benchmark's run end to end, 20-60 s: make test-slow (docs/testing.md)
@pytest.mark.timeout(300)
def test_bench_sessions_quick_implicit(tmp_path: Path) -> None:
    """`--implicit`: as many implicit conversations as sessions at each size (bulk ones the
    gateway finds: woken, each is a hit), and the mixed load's requests without a session
    (turns resending the whole conversation, new conversations) counted by the gateway."""
    argv = ["bench", "sessions", "--quick", "--implicit", "--skip-kv", "--no-progress"]
    proc = subprocess.run(
        [sys.executable, "-m", "ctxcache.cli", *argv, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "sessions.json").read_text())
    assert data["kv_results"] == [] and data["meta"]["implicit"] is True
    rows = data["results"]
    assert [r["size"] for r in rows] == [300, 1000]
    for r in rows:
        assert r["errors"] == {}
        # as many live implicit conversations as explicit sessions, each about the size
        # (the short-lived sessions the fill counted may have expired since: 2-8 s)
        explicit = r["live_sessions"] - r["live_implicit"]
        assert r["size"] <= r["live_implicit"] <= r["size"] * 1.3
        assert r["size"] * 0.9 <= explicit <= r["size"] * 1.3
        for op in ("turn", "implicit", "implicit_new"):
            assert r[f"{op}_n"] > 0 and 0 < r[f"{op}_p50_ms"] <= r[f"{op}_p99_ms"], op
        # the bulk's states are found as the gateway names them: each woken one is a hit
        assert r["woken"] == 20 and r["woken_results"]["hit"] == 20
        # every implicit turn of the mixed load a hit, every new conversation a miss,
        # nothing else (by the gateway's own counter)
        got = r["implicit_results"]
        assert got["hit"] == r["implicit_n"] and r["implicit_hit_ratio"] == 1.0
        assert got["miss"] == r["implicit_new_n"]
        assert got["branch"] == got["passed"] == got["unkept"] == 0
        # their KV was found in the sidecar (tagged with the session, not pinned)
        assert r["implicit_kv_hit_rate"] is not None and r["implicit_kv_hit_rate"] > 0.9
        # an implicit conversation costs Redis kilobytes: its session's keys, and a point
        assert 1_000 < r["redis_implicit_keys_bytes"] < 20_000
        assert 50 < r["redis_implicit_point_bytes"] < 1_000
        assert 1_000 < r["redis_bytes_per_implicit"] < 20_000
    table = (tmp_path / "sessions.md").read_text()
    assert "| implicit ÷ explicit turn p50 / p99 |" in table
    assert "implicit_p50_ratio" in data["targets"]
    check_png(tmp_path / "sessions.png")
