"""`ctxcache bench agents`: the four ways' loops against a fake gateway and vLLM (what each
sends, when its TTFT is taken, what a failing way does), and on the real vLLM (slow)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from benchmarks.agents import agents_report as report
from benchmarks.agents.agents import TOOLS, USER, Workload
from benchmarks.agents.agents_ways import run
from tests.benchmarks.test_commands import RUN_TIMEOUT_S, run_bench
from tests.utils import require_vllm

DELAY = 0.05  # the fake's pause before the first tool-call delta or text
STEPS = 2
WORK = Workload("fake", STEPS, ["result one", "result two"], 64)


def _sse(events: list[dict[str, Any]], pause_after: int) -> Iterator[bytes]:
    for i, event in enumerate(events):
        if i == pause_after:
            time.sleep(DELAY)
        yield b"data: " + orjson.dumps(event) + b"\n\n"


class Fake:
    """The gateway and vLLM: every request kept, every answer a stream whose first content
    comes DELAY after its first event (a role chunk, `response.created`)."""

    def __init__(self, fail: str | None = None) -> None:
        self.sent: list[dict[str, Any]] = []  # host, path, body; the call id answered
        self.fail = fail  # a path answered with a 400
        self.calls = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content) if request.content else {}
        sent = {"host": request.url.host, "path": request.url.path, "body": body}
        self.sent.append(sent)
        if request.url.path == self.fail:
            return httpx.Response(400, json={"error": {"message": "no", "code": "bad"}})
        if request.url.path == "/v1/context":
            return httpx.Response(200, json={"session_id": "ctx_fake"})
        if request.method == "DELETE":
            return httpx.Response(200, json={"deleted": True})
        self.calls += 1
        n, choice = self.calls, body["tool_choice"]
        sent["call"] = f"call_{n}" if choice != "none" else None
        if request.url.path == "/v1/responses":
            return httpx.Response(200, content=_sse(self._responses(n, choice), 2))
        return httpx.Response(200, content=_sse(self._chat(n, choice), 1))

    @staticmethod
    def _chat(n: int, choice: Any) -> list[dict[str, Any]]:
        usage = {"prompt_tokens": 100 * n, "prompt_tokens_details": {"cached_tokens": 64}}
        role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        if choice == "none":
            deltas = [{"content": "done"}]
        else:
            name = choice["function"]["name"]
            deltas = [
                {"tool_calls": [{"index": 0, "id": f"call_{n}", "function": {"name": name}}]},
                {"tool_calls": [{"index": 0, "function": {"arguments": '{"path": '}}]},
                {"tool_calls": [{"index": 0, "function": {"arguments": '"a"}'}}]},
            ]
        chunks = [{"choices": [{"index": 0, "delta": d}]} for d in deltas]
        return [role, *chunks, {"choices": [], "usage": usage}]

    @staticmethod
    def _responses(n: int, choice: Any) -> list[dict[str, Any]]:
        done: dict[str, Any] = {
            "id": f"resp_{n}",
            "usage": {"input_tokens": 100 * n, "input_tokens_details": {"cached_tokens": 64}},
        }
        events: list[dict[str, Any]] = [
            {"type": "response.created", "response": {"id": f"resp_{n}"}},
            {"type": "response.in_progress", "response": {"id": f"resp_{n}"}},
        ]
        if choice == "none":
            item = {"type": "message"}
            events += [{"type": "response.output_item.added", "item": item}]
            events += [{"type": "response.output_text.delta", "delta": "done"}]
        else:
            item = {"type": "function_call", "call_id": f"call_{n}", "name": choice["name"]}
            events += [{"type": "response.output_item.added", "item": {**item, "arguments": ""}}]
            events += [{"type": "response.function_call_arguments.delta", "delta": "{}"}]
            events += [{"type": "response.output_item.done", "item": {**item, "arguments": "{}"}}]
        return [*events, {"type": "response.completed", "response": done}]


def _run(fake: Fake, ways: list[str], rounds: int = 2) -> tuple[list[dict[str, Any]], dict]:
    args = argparse.Namespace(warmup=1, rounds=rounds)
    clients = {
        url: httpx.Client(base_url=url, transport=httpx.MockTransport(fake))
        for url in ("http://gateway", "http://vllm")
    }
    return run(args, ways, WORK, gateway="http://gateway", engine="http://vllm", clients=clients)


def _sent(fake: Fake, host: str, path: str) -> list[dict[str, Any]]:
    return [s for s in fake.sent if (s["host"], s["path"]) == (host, path)]


def _bodies(fake: Fake, host: str, path: str) -> list[dict[str, Any]]:
    return [s["body"] for s in _sent(fake, host, path)]


ALL = ["session", "stateless", "responses", "stateless-gateway"]


def test_each_way_sends_what_an_agent_sends_and_times_the_first_content() -> None:
    fake = Fake()
    records, errors = _run(fake, ALL)
    assert errors == {}
    requests = STEPS + 1  # the calls and the text answer
    for way in ALL:
        mine = [r for r in records if r["way"] == way and r["kind"] != "create"]
        assert [(r["round"], r["step"]) for r in mine] == [
            (n, k) for n in (1, 2) for k in range(1, requests + 1)
        ]  # the warm-up round is not counted
        for r in mine:  # not the role chunk, not response.created: the first content
            assert DELAY <= r["ttft_ms"] / 1e3 <= r["total_ms"] / 1e3, r
            assert r["cached_tokens"] == 64 and r["prompt_tokens"] >= 100
        assert [r["calls"] for r in mine[:requests]] == [["read_file"], ["run_command"], []]

    creates = _bodies(fake, "gateway", "/v1/context")
    assert len(creates) == 3  # one per loop, the warm-up's included
    assert creates[0]["tools"] == TOOLS and creates[0]["messages"][0]["role"] == "system"
    assert creates[0]["messages"] != creates[1]["messages"]  # each loop its own prefix

    # the session: only the new messages, the tool message answering the call returned
    chats = _sent(fake, "gateway", "/v1/chat/completions")
    sent = [s for s in chats if "session_id" in s["body"]][:requests]
    session = [s["body"] for s in sent]
    assert all(b["session_id"] == "ctx_fake" and b["tools"] == TOOLS for b in session)
    assert session[0]["messages"] == [{"role": "user", "content": USER}]
    (tool,) = session[1]["messages"]
    assert tool == {"role": "tool", "tool_call_id": sent[0]["call"], "content": "result one"}
    assert session[1]["tool_choice"] == {"type": "function", "function": {"name": "run_command"}}
    assert session[2]["tool_choice"] == "none"

    # stateless: the whole conversation, the assistant's call included
    last = _bodies(fake, "vllm", "/v1/chat/completions")[requests - 1]["messages"]
    assert [m["role"] for m in last] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    call = last[2]["tool_calls"][0]
    assert call["function"] == {"name": "read_file", "arguments": '{"path": "a"}'}
    assert last[3]["tool_call_id"] == call["id"] and last[5]["content"] == "result two"

    # stateless through the gateway: the same whole conversation, no session, no create
    gateway = [s["body"] for s in chats if "session_id" not in s["body"]]
    assert len(gateway) == 3 * requests  # its warm-up round's and 2 counted rounds'
    mine = gateway[requests - 1]["messages"]
    assert [m["role"] for m in mine] == [m["role"] for m in last]
    assert mine[3]["tool_call_id"] == mine[2]["tool_calls"][0]["id"]
    assert mine[5]["content"] == "result two" and gateway[0]["tools"] == TOOLS
    systems = {
        _bodies(fake, "vllm", "/v1/chat/completions")[0]["messages"][0]["content"],
        gateway[0]["messages"][0]["content"],
        creates[0]["messages"][0]["content"],
    }
    assert len(systems) == 3  # every loop its own prefix

    # Responses: function tools without the wrapper, the previous id, the call's output
    resp = _bodies(fake, "gateway", "/v1/responses")[:requests]
    assert resp[0]["tools"][0]["name"] == "read_file" and "previous_response_id" not in resp[0]
    assert resp[0]["tool_choice"] == {"type": "function", "name": "read_file"}
    first = _sent(fake, "gateway", "/v1/responses")[0]["call"]
    assert resp[1]["input"] == [
        {"type": "function_call_output", "call_id": first, "output": "result one"}
    ]
    assert resp[1]["previous_response_id"] == f"resp_{first.removeprefix('call_')}"
    assert all(b["instructions"] == resp[0]["instructions"] for b in resp)

    rows = report.rows(records, ALL, requests)
    totals = report.totals(records, ALL)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["kind"] == "answer"
    for r in rows:
        assert r["session_vs_stateless"] > 0 and r["responses_vs_stateless"] > 0
        assert r["stateless-gateway_vs_stateless"] > 0
        assert r["stateless-gateway"]["cached_tokens"] == 64
    assert totals["session"]["create_ms"] > 0 and len(totals["session"]["loop_ms_rounds"]) == 2
    assert totals["session_vs_stateless"] > 0 and totals["stateless-gateway"]["create_ms"] is None
    meta = {"steps": STEPS, "tool_tokens": 2, "rounds": 2, "totals": totals, "errors": {}}
    text = report.table(meta, rows, ALL)
    assert "| 3 (answer) |" in text and "| loop total ms | " in text
    assert "stateless-gateway cached / prompt" in text and "stateless-gateway ÷ stateless" in text


def test_a_failing_way_is_reported_with_its_answer_and_the_others_go_on() -> None:
    fake = Fake(fail="/v1/responses")
    records, errors = _run(fake, ["session", "responses"], rounds=1)
    assert set(errors) == {"responses"} and errors["responses"].startswith("400: ")
    assert '"code":"bad"' in errors["responses"] and "function" in errors["responses"]
    assert len([r for r in records if r["way"] == "session"]) == 1 + STEPS + 1
    assert len(_bodies(fake, "gateway", "/v1/responses")) == 1  # not asked again


@pytest.mark.slow  # minutes on 2 CPUs: `make test-slow` (CI runs it)
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_the_loop_on_vllm_reuses_the_history_every_way(tmp_path: Path, tiny_model: Path) -> None:
    require_vllm()
    out = tmp_path / "agents"
    data = run_bench(
        "agents",
        out,
        *("--model", str(tiny_model), "--preset", "tiny", "--steps", "2"),
        *("--tool-tokens", "60", "--rounds", "1", "--warmup", "0"),
    )
    meta = data["meta"]
    assert meta["errors"] == {} and meta["tool_call_parser"] == "hermes"
    assert meta["vllm_dtype"] and {"model", "amx", "avx512_bf16"} <= meta["cpu"].keys()
    rows = data["results"]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows[1:]:  # every way reuses the history from the second request on
        for way in ALL:  # (stateless-gateway: vLLM's own prefix cache, 256 blocks, at least)
            assert r[way]["cached_tokens"] >= 128, (way, r)
    for r in rows:  # vLLM's own TTFT of each request, read from its /metrics
        assert all(r[way]["engine_ttft_ms"] > 0 for way in ALL)
    assert "| loop total ms |" in (out / "agents.md").read_text()
