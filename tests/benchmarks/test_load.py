"""`ctxcache bench load`, reduced: concurrent sessions through a real stack, then the checks.

Each run starts its own Redis, sidecar, workers and gateway (the benchmark does that itself),
so these are integration tests of the stack under concurrency: the command exits 0 only if
no status other than 2xx/409/429/503 was seen, every session's stored history matches what
its client was answered, and Redis keys and sidecar bytes went back to the baseline after
half the sessions were deleted and half expired. The full-size run is in docs/reliability.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.load.load_driver import TurnResult, history_problems
from tests.utils import check_png

ALLOWED = {"200", "409", "429", "503"}


def run_load(out: Path, *args: str) -> dict[str, Any]:
    argv = ["bench", "load", "--out", str(out), "--expire-ttl", "1", "--deadline", "60", *args]
    proc = subprocess.run(
        [sys.executable, "-m", "ctxcache.cli", *argv],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    data = json.loads((out / "load.json").read_text())
    assert data["meta"]["benchmark"] == "load"
    (row,) = data["results"]
    assert row["ok"] and row["failures"] == []
    # "409 session_busy", "503 backend_unavailable", ...: only the documented ones
    assert {s.split()[0] for s in row["statuses"]} <= ALLOWED, row["statuses"]
    assert row["sessions_ok"] == row["sessions"] == row["sessions_gone"]
    assert row["turns_ok"] == row["turns_expected"]
    assert 0 < row["p50_ms"] <= row["p99_ms"]
    assert row["redis_keys"]["loaded"] > row["redis_keys"]["before"]
    assert row["redis_keys"]["after"] == row["redis_keys"]["before"]
    assert row["sidecar"]["after"] == row["sidecar"]["before"]
    assert {"gateway", "worker0"} <= set(row["rss_mib"])
    assert all(0 < v["start"] <= v["peak"] for v in row["rss_mib"].values())
    assert "| pass |" in (out / "load.md").read_text()
    check_png(out / "load.png")
    return row


@pytest.mark.slow  # a benchmark's run end to end, 10-20 s: make test-slow (docs/testing.md)
@pytest.mark.timeout(300)
def test_load_fake_backend(tmp_path: Path) -> None:
    row = run_load(tmp_path, "--backend", "fake", "--sessions", "40", "--turns", "3")
    # every 10th session sends its first turn twice at once: 4 extra turns, all committed
    assert row["turns_expected"] == 40 * 3 + 4
    assert row["sidecar"]["loaded"]["pinned_sessions"] == 40  # pinned while live, then released


@pytest.mark.slow  # ~20 s of load on the tiny model: make test-slow (CI runs it)
@pytest.mark.timeout(300)
def test_load_tiny_model(tmp_path: Path, tiny_model: Path) -> None:
    row = run_load(
        tmp_path,
        *("--backend", "tiny", "--sessions", "4", "--turns", "2", "--model", str(tiny_model)),
    )
    assert row["turns_expected"] == 4 * 2 + 1
    # the workers stored the sessions' KV in the sidecar, and all of it was released
    assert row["sidecar_bytes"]["loaded"] > 0
    assert row["sidecar_bytes"]["after"] == row["sidecar_bytes"]["before"]


def turn(index: int, prompt: int, completion: int, after: int) -> TurnResult:
    return TurnResult(prompt, completion, after, 0.0, index)


def test_history_check_catches_lost_duplicated_and_stale_turns() -> None:
    good = [turn(1, 110, 4, 114), turn(2, 124, 4, 128)]
    assert history_problems(100, good, stored_turns=3, stored_tokens=128) == []
    # a turn answered but not stored, or stored twice
    assert history_problems(100, good, stored_turns=2, stored_tokens=114)
    assert history_problems(100, good, stored_turns=4, stored_tokens=142)
    # the second turn was prompted without the first (a stale history) yet appended
    stale = [turn(1, 110, 4, 114), turn(2, 110, 4, 128)]
    assert history_problems(100, stale, stored_turns=3, stored_tokens=128)
