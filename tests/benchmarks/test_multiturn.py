"""`ctxcache bench multiturn` on the tiny model: a short replay through a stack it starts."""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from benchmarks.multiturn import multiturn_report as report
from benchmarks.multiturn.multiturn import TARGET_CONTEXT, user_token_targets
from benchmarks.multiturn.multiturn_replay import SYSTEM, Replay
from benchmarks.multiturn.multiturn_stacks import STATELESS_KEY, Mode, idle_cpu
from ctxcache.supervisor import Child, Supervisor
from tests.utils import check_png, require_vllm


def test_user_turns_follow_the_sharegpt_shape() -> None:
    users = user_token_targets(8, 100)
    context = TARGET_CONTEXT[0]
    for k in range(1, 8):
        context += 100 + users[k] + 10  # answer, new user message, template tokens
        assert abs(context - TARGET_CONTEXT[k]) <= 2


class FakeServers:
    """vLLM and the two gateways of `--engine vllm`: every request kept; each answer the
    same for every mode (a greedy model's), except `diverge`'s (host, conversation, turn)."""

    def __init__(self, diverge: tuple[str, int, int] | None = None) -> None:
        self.sent: list[dict[str, Any]] = []
        self.diverge = diverge
        self.users: dict[str, tuple[int, int]] = {}  # a user message's conversation and turn

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content) if request.content else {}
        auth = request.headers.get("authorization")
        self.sent.append(
            {"host": request.url.host, "auth": auth, "body": body, "at": time.monotonic()}
        )
        if request.url.path == "/v1/context":
            return httpx.Response(200, json={"session_id": f"ctx_{len(self.sent)}"})
        if request.method == "DELETE":
            return httpx.Response(200, json={"deleted": True})
        conv, turn = self.users[body["messages"][-1]["content"]]
        text = f"answer {conv}.{turn}"
        if self.diverge == (request.url.host, conv, turn):
            text += " but not quite"
        cached = {"vllm": 0, "gw-session": 100, "gw-stateless": 7}[request.url.host]
        usage = {"prompt_tokens": 200, "prompt_tokens_details": {"cached_tokens": cached}}
        chunks = [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"content": text}}]},
            {"choices": [], "usage": usage},
        ]
        sse = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks)
        return httpx.Response(200, content=sse + b"data: [DONE]\n\n")


def _replay(fake: FakeServers, switch_gap: float = 0.0) -> Replay:
    args = argparse.Namespace(
        api_key=None,
        model_name="m",
        conversations=2,
        turns=3,
        answer_tokens=8,
        seed=0,
        interleave=True,
        think_time=0.0,
        switch_gap=switch_gap,
    )
    modes = [
        Mode("vllm-full", "http://vllm", session=False),
        Mode("session", "http://gw-session", session=True),
        Mode("stateless-gateway", "http://gw-stateless", session=False, api_key=STATELESS_KEY),
    ]
    replay = Replay(args, modes, None, None, transport=httpx.MockTransport(fake))
    fake.users = {u: (c.index, t + 1) for c in replay.conversations for t, u in enumerate(c.users)}
    replay.run(threading.Event())
    return replay


def test_stateless_gateway_sends_the_whole_history_without_a_session_as_its_tenant() -> None:
    """The mode of issue 55: what a client that never sends `session_id` sends, to its own
    gateway with a key of its own tenant; its numbers set beside the others', its answers
    compared with vllm-full's."""
    fake = FakeServers()
    replay = _replay(fake)
    mine = [s for s in fake.sent if s["host"] == "gw-stateless"]
    assert len(mine) == 2 * 3  # no create, no delete: chat requests only
    assert all(s["auth"] == f"Bearer {STATELESS_KEY}" for s in mine)
    others = [s for s in fake.sent if s["host"] != "gw-stateless"]
    assert all(s["auth"] is None for s in others)  # the run's --api-key (none)
    for s in mine:
        body = s["body"]
        assert "session_id" not in body and "cache_salt" not in body
    full = [s["body"]["messages"] for s in fake.sent if s["host"] == "vllm"]
    assert [s["body"]["messages"] for s in mine] == full  # the whole history, as vllm-full's
    assert [m["role"] for m in mine[-1]["body"]["messages"]] == [
        *("system", "user", "assistant", "user", "assistant", "user")
    ]
    assert mine[0]["body"]["messages"][0] == {"role": "system", "content": SYSTEM}
    session = [s["body"] for s in fake.sent if s["host"] == "gw-session" and "stream" in s["body"]]
    assert all(len(b["messages"]) == 1 and b["session_id"] for b in session)

    rows = replay.rows()
    for r in rows:
        m = r["stateless-gateway"]
        assert m["cached_tokens"] == 7 and m["prompt_tokens"] == 200 and m["ttft_p50_ms"] > 0
        assert m["identical"] == 2 and r["identical_outputs"] is True
        assert r["stateless-gateway_vs_session"] > 0 and "speedup_vs_reference" in m
    names = [m.name for m in replay.modes]
    summary = report.summary(rows, names, replay)
    assert summary["differences"] == [] and "stateless-gateway_vs_session_last_turn" in summary
    table = report.table(rows, names, replay.reference)
    assert "stateless-gateway TTFT p50 / p90 ms" in table and "stateless-gateway / session" in table
    assert "stateless-gateway 2" in table  # same answer as vllm-full, both conversations


def test_a_request_to_another_engine_waits_until_the_last_engine_idled_the_gap() -> None:
    """vLLM's workers spin for 1 s after each message: the next mode's engine is asked only
    once the last one has idled `--switch-gap` seconds; the same engine is asked at once."""
    gap = 0.2
    fake = FakeServers()
    _replay(fake, switch_gap=gap)
    chats = [s for s in fake.sent if "stream" in s["body"]]
    switches = [(a, b) for a, b in itertools.pairwise(chats) if a["host"] != b["host"]]
    stays = [(a, b) for a, b in itertools.pairwise(chats) if a["host"] == b["host"]]
    assert switches and stays  # the alternating order of the modes gives both
    assert all(b["at"] - a["at"] >= gap for a, b in switches)
    assert all(b["at"] - a["at"] < gap for a, b in stays)


def test_a_stateless_gateway_answer_unlike_vllm_full_is_a_difference() -> None:
    replay = _replay(FakeServers(diverge=("gw-stateless", 1, 2)))
    (diff,) = replay.differences()
    assert (diff["mode"], diff["conversation"], diff["turn"]) == ("stateless-gateway", 1, 2)
    assert diff["same_answer_as"] == ["stateless-gateway"]
    rows = replay.rows()
    assert [r["stateless-gateway"]["identical"] for r in rows] == [2, 1, 1]
    assert [r["session"]["identical"] for r in rows] == [2, 2, 2]
    assert [r["identical_outputs"] for r in rows] == [True, False, False]


@pytest.mark.slow  # ~20 s of replay on the tiny model: make test-slow (CI runs it)
def test_short_replay_writes_the_documented_outputs(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "ctxcache.cli", "bench", "multiturn", "--quick"),
            *("--engine", "builtin", "--model", str(tiny_model)),
            *("--modes", "session,full,full-apc,stateless-gateway", "--threads", "1"),
            *("--out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "multiturn.json").read_text())
    assert {"benchmark", "date", "command", "machine", "modes"} <= data["meta"].keys()
    modes = ["session", "full", "full-apc", "stateless-gateway", "floor"]
    assert data["meta"]["modes"] == modes
    turns = data["results"]  # one row per turn
    assert [t["turn"] for t in turns] == [1, 2, 3]
    for t in turns:
        for mode in modes:
            assert t[mode]["ttft_p50_ms"] > 0 and t[mode]["ttft_p90_ms"] >= t[mode]["ttft_p50_ms"]
            assert t[mode]["prompt_tokens"] > 0
        assert t["session"]["prompt_tokens"] == t["full"]["prompt_tokens"]
        assert t["full"]["cached_ratio"] == 0  # a fresh cache_salt per request: no reuse
        assert t["identical_outputs"] is True  # greedy answers do not depend on the mode
        assert {"speedup_vs_reference", "total_p50_ms", "request_bytes"} <= t["session"].keys()
        assert "session_vs_floor" in t and "stateless-gateway_vs_session" in t
        assert t["stateless-gateway"]["prompt_tokens"] == t["full"]["prompt_tokens"]
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
    # stateless-gateway's first request follows the session's same prompt on the same worker
    # (the order of the modes alternates: conversation 0's first turn starts with the
    # session): its own tenant, so it reuses none of it
    (first,) = [
        r
        for r in data["requests"]
        if (r["mode"], r["conversation"], r["turn"]) == ("stateless-gateway", 0, 1)
    ]
    assert first["cached_tokens"] == 0, first
    stateless = turns[-1]["stateless-gateway"]["request_bytes"]
    assert stateless > 1.5 * turns[-1]["session"]["request_bytes"]  # the whole history
    assert turns[-1]["full"]["request_bytes"] > 1.5 * turns[-1]["session"]["request_bytes"]
    summary = data["summary"]
    assert summary["identical_outputs_every_turn"] is True
    assert {"session_speedup_last_turn", "session_vs_floor_max_from_turn_2"} <= summary.keys()
    assert "stateless-gateway_vs_session_last_turn" in summary
    assert summary["reference"] == "full" and summary["differences"] == []
    assert len(data["requests"]) == 2 * 3 * 5
    assert "| turn |" in (out / "multiturn.md").read_text()
    check_png(out / "multiturn.png")


@pytest.mark.slow  # minutes on 2 CPUs: `make test-slow` (CI runs it)
@pytest.mark.timeout(900)
def test_the_vllm_replay_under_kv_pressure_writes_the_documented_outputs(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The real engine and the real regime, tiny: vLLM alone against a ctxcache session over
    vLLM with the connector and the whole history through that stack without a session
    (stateless-gateway), conversations interleaved, a KV cache of 16 blocks. The files,
    not the speed."""
    require_vllm()
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "ctxcache.cli", "bench", "multiturn", "--quick"),
            *("--engine", "vllm", "--model", str(tiny_model), "--interleave"),
            *("--modes", "vllm-full,session,stateless-gateway", "--kv-blocks", "16"),
            *("--threads", "1"),
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
    modes = ["vllm-full", "session", "stateless-gateway"]
    assert data["meta"]["modes"] == modes and data["meta"]["kv_blocks"] == 16
    rows = data["results"]
    assert [r["turn"] for r in rows] == [1, 2, 3]
    for r in rows:
        for mode in modes:
            assert r[mode]["ttft_p50_ms"] > 0 and r[mode]["prompt_tokens"] > 0
        for mode in modes[1:]:
            assert r[mode]["prompt_tokens"] == r["vllm-full"]["prompt_tokens"]
            assert r[mode]["identical"] == 2  # both conversations answered like vLLM alone
            assert "speedup_vs_reference" in r[mode]
        assert r["stateless-gateway_vs_session"] > 0
    summary = data["summary"]
    assert summary["reference"] == "vllm-full" and summary["differences"] == []
    assert summary["session_bytes_last_over_first"] < summary["vllm-full_bytes_last_over_first"]
    assert "stateless-gateway_vs_session_last_turn" in summary
    assert len(data["requests"]) == 2 * 3 * 3
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
