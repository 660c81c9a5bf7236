"""`ctxcache bench agents --capacity`: what each mode sends at each step (against a fake
engine), the options and `--quick`, the answer check across modes, and a real run of
`--quick` (the tiny model, real vLLM, one engine at a time; slow)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from benchmarks.agents import agents_capacity
from benchmarks.agents.agents import TOOLS, USER, add_arguments, resolve_loop
from benchmarks.agents.agents_capacity import CAPACITY, QUICK, prompt_tokens_by_step, resolve
from benchmarks.agents.agents_load import SHARED_SYSTEM, AgentDriver, AgentTexts, AgentWorkload
from benchmarks.capacity import capacity_report as report
from benchmarks.capacity.capacity_load import Point
from tests.utils import check_png, require_vllm

DELAY = 0.02  # the fake's pause before the first tool-call delta or text
WORK = AgentWorkload(agents=2, steps=2, system_tokens=20, task_tokens=10, tool_tokens=12)


class FakeEngine:
    """vLLM and the gateway: every request kept; a forced call answered with a streamed call
    (`call_N`, its arguments from the request's length, so a longer prompt answers
    otherwise), `none` with text; `broken`: a call whose arguments are not JSON."""

    def __init__(self, broken: bool = False) -> None:
        self.sent: list[tuple[str, str, dict[str, Any]]] = []
        self.n = 0
        self.broken = broken

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content) if request.content else {}
        self.sent.append((request.method, request.url.path, body))
        if request.method == "DELETE":
            return httpx.Response(200, json={"deleted": True})
        self.n += 1
        choice = body["tool_choice"]
        role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        if choice == "none":
            deltas: list[dict[str, Any]] = [{"content": "fixed"}, {"content": " it"}]
        else:
            name = choice["function"]["name"]
            args = '{"path": ' if self.broken else f'{{"path": "{len(body["messages"])}"}}'
            first = {"index": 0, "id": f"call_{self.n}", "function": {"name": name}}
            deltas = [{"tool_calls": [first]}]
            deltas += [{"tool_calls": [{"index": 0, "function": {"arguments": args}}]}]
        usage = {
            "prompt_tokens": 100 * len(body["messages"]),
            "prompt_tokens_details": {"cached_tokens": 50},
            "completion_tokens": 7,
        }
        chunks = [role, *({"choices": [{"index": 0, "delta": d}]} for d in deltas)]
        chunks.append({"choices": [], "usage": usage})
        headers = {"x-session-id": "ctx_1"} if request.url.path == "/v1/context" else {}

        async def events() -> Any:
            for i, chunk in enumerate(chunks):
                if i == 1:
                    await asyncio.sleep(DELAY)
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, content=events(), headers=headers)


def drive_one(mode: str, session: bool, fake: FakeEngine, rounds: int = 3) -> Point:
    """One agent's loop through the driver (agent 7, `rounds` requests)."""
    texts = AgentTexts(WORK, None)
    driver = AgentDriver(mode, "http://engine", "m", texts, session=session)
    point = Point(mode, 1.0)

    async def go() -> None:
        async with httpx.AsyncClient(
            base_url="http://engine", transport=httpx.MockTransport(fake)
        ) as http:
            counters = {"sent": 0, "user": 0}
            t0 = time.perf_counter()
            await driver._user(http, 7, rounds, 0.0, 0.0, t0, counters, 99, point, None)

    asyncio.run(go())
    return point


def test_a_full_history_agent_resends_its_conversation_with_each_call_and_result() -> None:
    fake = FakeEngine()
    point = drive_one("vllm-full-connector", False, fake)
    agent = AgentTexts(WORK, None).user(7)
    bodies = [b for _, path, b in fake.sent]
    assert [path for _, path, _ in fake.sent] == ["/v1/chat/completions"] * 3
    for b in bodies:  # every request: the tools, a stream with usage, greedy
        assert b["tools"] == TOOLS and b["stream"] and b["stream_options"]["include_usage"]
        assert b["temperature"] == 0 and "session_id" not in b
    assert [b["tool_choice"] for b in bodies] == [
        {"type": "function", "function": {"name": "read_file"}},
        {"type": "function", "function": {"name": "run_command"}},
        "none",  # the last step answers in text
    ]
    system, user = bodies[0]["messages"]
    assert system["role"] == "system" and system["content"].startswith(SHARED_SYSTEM)
    assert user["role"] == "user" and user["content"].startswith(f"Task 000007. {USER}")
    last = bodies[2]["messages"]
    assert [m["role"] for m in last] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert last[2]["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "read_file", "arguments": '{"path": "2"}'},
        }
    ]
    assert last[3] == {"role": "tool", "tool_call_id": "call_1", "content": agent.results[0]}
    assert last[4]["tool_calls"][0]["id"] == "call_2" and last[5]["tool_call_id"] == "call_2"
    assert last[5]["content"] == agent.results[1] and bodies[1]["messages"] == last[:4]
    sent = point.sent
    assert [(s.user, s.round, s.index) for s in sent] == [(7, 1, 0), (7, 2, 1), (7, 3, 2)]
    assert [s.answer for s in sent] == [
        'read_file({"path": "2"})',
        'run_command({"path": "4"})',
        "fixed it",
    ]
    for s in sent:  # TTFT: the first tool-call delta or text, not the role chunk
        assert s.error is None and DELAY <= s.ttft <= s.total
        assert s.cached_tokens == 50 and s.completion_tokens == 7 and not s.create
    assert [s.prompt_tokens for s in sent] == [200, 400, 600]


def test_a_session_agent_creates_with_its_opening_then_sends_only_each_result() -> None:
    fake = FakeEngine()
    point = drive_one("session", True, fake)
    agent = AgentTexts(WORK, None).user(7)
    (create, *turns, delete) = fake.sent
    assert create[:2] == ("POST", "/v1/context") and delete[:2] == ("DELETE", "/v1/context/ctx_1")
    body = create[2]
    assert body["messages"] == agent.opening and body["tools"] == TOOLS and body["stream"]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "read_file"}}
    assert [(m, p) for m, p, _ in turns] == [("POST", "/v1/chat/completions")] * 2
    first, last = (b for _, _, b in turns)
    assert first["session_id"] == "ctx_1" and first["tools"] == TOOLS
    assert first["messages"] == [
        {"role": "tool", "tool_call_id": "call_1", "content": agent.results[0]}
    ]
    assert last["messages"][0]["tool_call_id"] == "call_2" and last["tool_choice"] == "none"
    assert [s.create for s in point.sent] == [True, False, False]
    assert all(s.error is None and s.ttft >= DELAY for s in point.sent)


def test_a_broken_call_is_an_error_and_ends_the_agent() -> None:
    fake = FakeEngine(broken=True)
    point = drive_one("vllm-full", False, fake)
    (only,) = point.sent
    assert only.error and "no whole tool call" in only.error and len(fake.sent) == 1


def test_a_staggered_first_agent_leaves_before_its_text_answer() -> None:
    fake = FakeEngine()
    point = drive_one("vllm-full", False, fake, rounds=2)
    assert [s.round for s in point.sent] == [1, 2]
    assert all(b["tool_choice"] != "none" for _, _, b in fake.sent)


def test_every_agent_shares_the_system_prompt_and_has_its_own_task_and_results() -> None:
    texts = AgentTexts(WORK, None)
    a, b = texts.user(0), texts.user(100_000)
    assert a.opening[0] == b.opening[0]  # vLLM's prefix cache shares it
    assert "task 0" not in a.opening[0]["content"]
    assert a.opening[1] != b.opening[1] and len(a.results) == WORK.steps
    assert AgentTexts(WORK, None).user(0) == a  # the same in every mode
    assert (WORK.users, WORK.rounds) == (2, 3)  # what capacity's driver reads


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_capacity_options_default_to_capacity_and_quick_and_given_ones_win() -> None:
    args = parse("--capacity")
    resolve(args)
    for name, value in CAPACITY.items():
        if name != "warmup":
            assert getattr(args, name) == value, name
    assert args.warmup == 2 * 8  # two requests per agent
    quick = parse("--capacity", "--quick", "--agents", "3")
    resolve(quick)
    assert quick.agents == 3 and quick.steps == QUICK["steps"] and quick.preset == "tiny"
    assert quick.keep_going and quick.warmup == QUICK["warmup"] and quick.qps == "1,2"
    given = parse("--capacity", "--kv-blocks", "99", "--steps", "4", "--modes", "session")
    resolve(given)
    assert (given.kv_blocks, given.steps, given.modes, given.warmup) == (99, 4, "session", 16)
    loop = parse("--steps", "5")  # without --capacity: the loop's own defaults
    resolve_loop(loop)
    assert not loop.capacity and loop.steps == 5
    assert (loop.tool_tokens, loop.warmup, loop.kv_blocks, loop.max_model_len) == (
        200,
        1,
        256,
        4096,
    )


def test_bad_modes_are_refused_before_any_engine_starts(capsys: pytest.CaptureFixture) -> None:
    assert agents_capacity.main(parse("--capacity", "--modes", "roomy")) == 2
    assert "roomy" in capsys.readouterr().err


def test_answers_are_compared_with_vllm_full_connectors_per_agent_and_step() -> None:
    """The full-history mode and the session answer the same first call; a session's later
    prompt (longer here: the fake answers by the messages' count) may part from it, and the
    conversation is counted until its first difference."""
    modes = {"vllm-full-connector": False, "session": True}
    points = [drive_one(m, session, FakeEngine()) for m, session in modes.items()]
    got = report.compare(report.answers(points))
    assert got["reference"] == "vllm-full-connector"
    assert (got["compared"], got["mismatches"], got["after_divergence"]) == (2, 1, 1)
    assert got["examples"][0]["round"] == 2  # the second call: the prompts differ
    by_step = prompt_tokens_by_step(points)
    assert by_step["vllm-full-connector"] == {1: 200, 2: 400, 3: 600}
    assert by_step["session"] == {1: 200, 2: 100, 3: 100}


def test_a_run_offers_the_rate_with_new_agents_as_capacitys_driver_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeEngine()
    client = functools.partial(httpx.AsyncClient, transport=httpx.MockTransport(fake))
    monkeypatch.setattr(httpx, "AsyncClient", client)
    texts = AgentTexts(WORK, None)
    driver = AgentDriver("vllm-full", "http://engine", "m", texts, session=False)
    point = asyncio.run(driver.run(200.0, 6, 2, first_user=100_000))
    assert len([s for s in point.sent if s.index >= 0]) == 8 and not any(
        s.error for s in point.sent
    )
    firsts = {s.user: max(t.round for t in point.sent if t.user == s.user) for s in point.sent}
    assert firsts[100_000] == 3 and firsts[100_001] == 2  # staggered: 3 - i % 3
    assert min(firsts) == 100_000  # this rate's own agents
    row = report.row(point, 2, 2.0)
    assert row["requests"] == 6 and row["errors"] == 0 and row["cached_ratio"] > 0


@pytest.mark.slow  # minutes on 2 CPUs: `make test-slow` (CI runs it)
@pytest.mark.timeout(900)
def test_quick_agent_capacity_run_on_vllm(tiny_model: Path, tmp_path: Path) -> None:
    """Two modes, each engine alone, two rates of agents: the files, the rows, and the
    answers (the first calls' prompts are the same: their answers must be too)."""
    import subprocess
    import sys

    require_vllm()
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "ctxcache.cli", "bench", "agents", "--capacity", "--quick"),
            *("--model", str(tiny_model), "--modes", "vllm-full-connector,session"),
            *("--dtype", "float32", "--out", str(out)),  # float32: answers compared exactly
        ],
        capture_output=True,
        text=True,
        timeout=840,
    )
    logs = "".join(p.read_text()[-2000:] for p in sorted(out.glob("servers-*.log")))
    assert proc.returncode == 0, proc.stderr[-3000:] + logs
    data = json.loads((out / "agents-capacity.json").read_text())
    meta = data["meta"]
    assert meta["modes"] == ["vllm-full-connector", "session"] and meta["qps"] == [1.0, 2.0]
    assert meta["dtype"] == "float32" and meta["tool_call_parser"] == "hermes"
    rows = data["results"]
    assert [(r["mode"], r["qps"]) for r in rows] == [
        ("vllm-full-connector", 1.0),
        ("vllm-full-connector", 2.0),
        ("session", 1.0),
        ("session", 2.0),
    ]
    for r in rows:
        assert r["requests"] == 6 and r["errors"] == 0 and r["ttft_p50_ms"] > 0
    assert all(r["creates"] > 0 for r in rows if r["mode"] == "session")
    sent = data["requests"]
    calls = [s for s in sent if s["round"] <= 2]  # forced calls: JSON arguments
    assert calls and all(s["answer"].startswith(("read_file(", "run_command(")) for s in calls)
    firsts: dict[tuple[float, int], dict[str, str]] = {}
    for s in sent:
        if s["round"] == 1:
            firsts.setdefault((s["qps"], s["user"]), {})[s["mode"]] = s["answer"]
    both = [a for a in firsts.values() if len(a) == 2]
    assert both and all(a["session"] == a["vllm-full-connector"] for a in both), both
    answers = data["summary"]["answers"]
    assert answers["reference"] == "vllm-full-connector" and answers["compared"] >= len(both)
    steps = data["summary"]["prompt_tokens_by_step"]
    assert steps["session"]["1"] == steps["vllm-full-connector"]["1"]  # the same first prompt
    assert "| mode | offered req/s |" in (out / "agents-capacity.md").read_text()
    check_png(out / "agents-capacity.png")
