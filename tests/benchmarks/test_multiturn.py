"""`ctxcache bench multiturn` on the tiny model: a short replay through a stack it starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.multiturn.multiturn import TARGET_CONTEXT, user_token_targets
from benchmarks.multiturn.multiturn_stacks import idle_cpu
from ctxcache.supervisor import Child, Supervisor
from tests.utils import check_png, require_vllm


def test_user_turns_follow_the_sharegpt_shape() -> None:
    users = user_token_targets(8, 100)
    context = TARGET_CONTEXT[0]
    for k in range(1, 8):
        context += 100 + users[k] + 10  # answer, new user message, template tokens
        assert abs(context - TARGET_CONTEXT[k]) <= 2


@pytest.mark.slow  # ~20 s of replay on the tiny model: make test-slow (CI runs it)
def test_short_replay_writes_the_documented_outputs(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "ctxcache.cli", "bench", "multiturn", "--quick"),
            *("--engine", "builtin", "--model", str(tiny_model)),
            *("--modes", "session,full,full-apc", "--threads", "1"),
            *("--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "multiturn.json").read_text())
    assert {"benchmark", "date", "command", "machine", "modes"} <= data["meta"].keys()
    assert data["meta"]["modes"] == ["session", "full", "full-apc", "floor"]
    turns = data["results"]  # one row per turn
    assert [t["turn"] for t in turns] == [1, 2, 3]
    for t in turns:
        for mode in ("session", "full", "full-apc", "floor"):
            assert t[mode]["ttft_p50_ms"] > 0 and t[mode]["ttft_p90_ms"] >= t[mode]["ttft_p50_ms"]
            assert t[mode]["prompt_tokens"] > 0
        assert t["session"]["prompt_tokens"] == t["full"]["prompt_tokens"]
        assert t["full"]["cached_ratio"] == 0  # a fresh cache_salt per request: no reuse
        assert t["identical_outputs"] is True  # greedy answers do not depend on the mode
        assert {"speedup_vs_reference", "total_p50_ms", "request_bytes"} <= t["session"].keys()
        assert "session_vs_floor" in t
    # from turn 2 on, a session turn reuses (at least) the last turn's prompt, in 16-token
    # blocks, and sends only the new message
    for r in data["requests"]:
        if r["mode"] == "session" and r["turn"] > 1:
            (prev,) = [
                q["prompt_tokens"]
                for q in data["requests"]
                if q["mode"] == "session"
                and q["conversation"] == r["conversation"]
                and q["turn"] == r["turn"] - 1
            ]
            assert r["cached_tokens"] >= prev // 16 * 16
    assert turns[-1]["full"]["request_bytes"] > 1.5 * turns[-1]["session"]["request_bytes"]
    summary = data["summary"]
    assert summary["identical_outputs_every_turn"] is True
    assert {"session_speedup_last_turn", "session_vs_floor_max_from_turn_2"} <= summary.keys()
    assert summary["reference"] == "full" and summary["differences"] == []
    assert len(data["requests"]) == 2 * 3 * 4
    assert "| turn |" in (out / "multiturn.md").read_text()
    check_png(out / "multiturn.png")


@pytest.mark.slow  # minutes on 2 CPUs: `make test-slow` (CI runs it)
@pytest.mark.timeout(900)
def test_the_vllm_replay_under_kv_pressure_writes_the_documented_outputs(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The real engine and the real regime, tiny: vLLM alone against a ctxcache session over
    vLLM with the connector, conversations interleaved, a KV cache of 16 blocks. The files,
    not the speed."""
    require_vllm()
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "ctxcache.cli", "bench", "multiturn", "--quick"),
            *("--engine", "vllm", "--model", str(tiny_model), "--interleave"),
            *("--modes", "vllm-full,session", "--kv-blocks", "16", "--threads", "1"),
            *("--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=840,
    )
    logs = (out / "servers.log").read_text()[-3000:] if (out / "servers.log").exists() else ""
    assert proc.returncode == 0, proc.stderr[-3000:] + logs
    data = json.loads((out / "multiturn.json").read_text())
    assert data["meta"]["engine"] == "vllm" and data["meta"]["interleave"] is True
    assert data["meta"]["modes"] == ["vllm-full", "session"] and data["meta"]["kv_blocks"] == 16
    rows = data["results"]
    assert [r["turn"] for r in rows] == [1, 2, 3]
    for r in rows:
        for mode in ("vllm-full", "session"):
            assert r[mode]["ttft_p50_ms"] > 0 and r[mode]["prompt_tokens"] > 0
        assert r["session"]["prompt_tokens"] == r["vllm-full"]["prompt_tokens"]
        assert r["session"]["identical"] == 2  # both conversations answered like vLLM alone
        assert "speedup_vs_reference" in r["session"]
    summary = data["summary"]
    assert summary["reference"] == "vllm-full" and summary["differences"] == []
    assert summary["session_bytes_last_over_first"] < summary["vllm-full_bytes_last_over_first"]
    assert len(data["requests"]) == 2 * 3 * 2
    assert "| turn |" in (out / "multiturn.md").read_text()
    check_png(out / "multiturn.png")


def test_idle_cpu_tells_a_busy_server_from_an_idle_one(tmp_path: Path) -> None:
    """What `bench multiturn` records of the servers it keeps up: each one's CPU over a
    window, its child processes included (vLLM's engine core and worker are children)."""
    with (tmp_path / "out.log").open("w") as out, Supervisor(out=out) as sup:
        spin = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'while 1: pass'])"
        sup.start(Child("busy", [sys.executable, "-c", spin]))
        sup.start(Child("idle", [sys.executable, "-c", "import time; time.sleep(60)"]))
        got = idle_cpu(sup, seconds=1.0)
    assert got is not None and set(got) == {"busy", "idle"}
    assert got["busy"] > 40 and got["idle"] < 5, got
