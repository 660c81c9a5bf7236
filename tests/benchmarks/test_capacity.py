"""`ctxcache bench capacity`: what makes a rate held, the answer check, and a real run of
`--quick` (the tiny model, real vLLM, one engine at a time)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import capacity_report as report
from benchmarks.capacity_load import Point, Sent
from tests.utils import check_png, require_vllm


def point(
    mode: str, qps: float, ttfts: list[float], *, gap: float, error: str | None = None
) -> Point:
    """Questions sent every `gap` seconds with these TTFTs (the first two are warm-up)."""
    p = Point(mode, qps)
    for i, ttft in enumerate(ttfts):
        p.sent.append(
            Sent(user=i, round=1, index=i, due=i * gap, sent=i * gap, ttft=ttft, total=ttft + 0.1)
        )
    p.sent[-1].error = error
    p.sent[-1].ttft = ttfts[-1]
    return p


def test_a_rate_is_held_only_within_the_slo_at_the_offered_rate_without_errors() -> None:
    fast = report.row(point("session", 1.0, [9.0, 9.0] + [0.3] * 20, gap=1.0), 2, 2.0)
    assert fast["held"] and fast["requests"] == 20  # the slow warm-up does not count
    assert abs(fast["achieved_qps"] - 1.0) < 1e-9 and fast["ttft_p95_ms"] == 300.0
    slow = report.row(point("session", 1.0, [0.3] * 18 + [2.5] * 4, gap=1.0), 2, 2.0)
    assert not slow["held"]  # p95 over 2 s
    behind = report.row(point("session", 1.0, [0.3] * 22, gap=1.25), 2, 2.0)
    assert not behind["held"] and behind["achieved_qps"] == 0.8  # it could not keep up
    failed = report.row(point("session", 1.0, [0.3] * 22, gap=1.0, error="503"), 2, 2.0)
    assert not failed["held"] and failed["errors"] == 1
    rows = [fast, slow | {"qps": 2.0}, report.row(point("roomy", 0.5, [0.1] * 22, gap=2), 2, 2)]
    assert report.capacity(rows, ["session", "roomy", "vllm-full"]) == {
        "session": 1.0,
        "roomy": 0.5,
        "vllm-full": None,
    }


def test_session_answers_are_compared_with_the_same_engines_full_history_answers() -> None:
    ref, ses = Point("vllm-full-connector", 1.0), Point("session", 1.0)
    for user, (a, b) in enumerate([("x y", "x y"), ("p q", "p r")]):
        ref.sent.append(Sent(user, 1, user, 0, 0, answer=a))
        ses.sent.append(Sent(user, 1, user, 0, 0, answer=b))
    ses2 = Point("session", 2.0)  # a rate the reference never ran: compared with any rate
    ses2.sent.append(Sent(0, 1, 0, 0, 0, answer="x y"))
    ref.sent.append(Sent(1, 2, 2, 0, 0, answer="z"))  # user 1's round 2: after it diverged
    ses.sent.append(Sent(1, 2, 2, 0, 0, answer="w"))
    got = report.compare([ref, ses, ses2])
    assert got["reference"] == "vllm-full-connector"
    assert (got["compared"], got["mismatches"], got["after_divergence"]) == (3, 1, 1)
    assert got["examples"] == [{"qps": 1.0, "user": 1, "round": 1, "first_different_char": 2}]


@pytest.mark.timeout(900)
def test_quick_capacity_run_on_vllm_writes_the_documented_outputs(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Two modes, each engine alone, two rates: the files, the rows, the answer check."""
    require_vllm()
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "ctxcache.cli", "bench", "capacity", "--quick"),
            *("--model", str(tiny_model), "--modes", "vllm-full-connector,session"),
            *("--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=840,
    )
    logs = "".join(p.read_text()[-2000:] for p in sorted(out.glob("servers-*.log")))
    assert proc.returncode == 0, proc.stderr[-3000:] + logs
    assert {p.name for p in out.glob("servers-*.log")} == {
        "servers-vllm-full-connector.log",
        "servers-session.log",
    }  # one engine at a time, each with its own log
    data = json.loads((out / "capacity.json").read_text())
    meta = data["meta"]
    assert meta["modes"] == ["vllm-full-connector", "session"] and meta["qps"] == [1.0, 2.0]
    rows = data["results"]
    assert [(r["mode"], r["qps"]) for r in rows] == [
        ("vllm-full-connector", 1.0),
        ("vllm-full-connector", 2.0),
        ("session", 1.0),
        ("session", 2.0),
    ]
    for r in rows:
        assert r["requests"] == 6 and r["errors"] == 0 and r["ttft_p50_ms"] > 0
        assert r["engine_steps"] > 0 and r["connector_ms"] is not None
    session = [r for r in rows if r["mode"] == "session"]
    assert all(r["creates"] > 0 and r["cached_ratio"] > 0.3 for r in session)
    answers = data["summary"]["answers"]
    assert answers["reference"] == "vllm-full-connector" and answers["compared"] >= 12
    assert answers["mismatches"] == 0, answers
    assert "| mode | offered req/s |" in (out / "capacity.md").read_text()
    check_png(out / "capacity.png")
