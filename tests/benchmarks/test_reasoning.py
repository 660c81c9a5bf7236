"""`ctxcache bench reasoning`: the three modes against a fake gateway and vLLM that count
tokens the way a thinking model's template and a prefix cache do (what each mode sends,
the rows, the bounds, the comparison with the reference), and `--quick` on the real vLLM
with the thinking preset (slow)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from benchmarks.agents.agents import TOOLS
from benchmarks.reasoning import reasoning_report as report
from benchmarks.reasoning.reasoning import MODES, Workload
from benchmarks.reasoning.reasoning_modes import RULE_FIELD, run
from benchmarks.reasoning.reasoning_stack import KEYS
from tests.benchmarks.test_commands import RUN_TIMEOUT_S, run_bench
from tests.utils import check_png, require_vllm

DELAY = 0.05  # the fake's pause before the first reasoning delta
SYSTEM, USER, TOOL, THINK, OUT = 30, 10, 10, 8, 12  # the fake's tokens of each part
CALLS, TURNS = 2, 3
WORK = Workload(
    "fake",
    CALLS,
    [[f"question {c}.{u}" for u in range(TURNS)] for c in range(2)],
    [[[f"result {c}.{u}.{k}" for k in range(CALLS)] for u in range(TURNS)] for c in range(2)],
    64,
)
Segment = tuple[str, int, int]  # (kind, user turn, tokens)


def _common(a: list[Segment], b: list[Segment]) -> int:
    """The tokens of the longest common prefix: what a prefix cache reuses."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += x[2]
    return n


class Fake:
    """The gateway (a session's stored tokens, re-based on the template's rendering at a user
    message under `template`) and vLLM (the whole conversation rendered as the thinking
    template does: an assistant message's reasoning only after the last user message; its
    prefix cache per conversation and salt). Answers depend on the conversation, turn and
    step only, except `diverge`'s (rule, turn, step, all from 1): its thought differs."""

    def __init__(self, diverge: tuple[str, int, int] | None = None) -> None:
        self.sent: list[dict[str, Any]] = []
        self.sessions: dict[str, dict[str, Any]] = {}
        # vLLM's prefix cache: a conversation's last tokens, by its cache_salt
        self.cache: dict[tuple[int, str | None], list[Segment]] = {}
        self.diverge = diverge
        self.ids = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.content) if request.content else {}
        auth = request.headers.get("authorization")
        self.sent.append({"host": request.url.host, "path": request.url.path, "body": body})
        self.sent[-1]["auth"] = auth
        if request.url.path == "/v1/context":
            sid = f"ctx_{len(self.sessions)}"
            conv = int(re.findall(r"case (\d+)", body["messages"][0]["content"])[0])
            rule = body[RULE_FIELD]
            self.sessions[sid] = {"conv": conv, "rule": rule, "tokens": [("sys", 0, SYSTEM)]}
            self.sessions[sid] |= {"turn": 0, "step": 0}
            return httpx.Response(200, json={"session_id": sid})
        if request.method == "DELETE":
            return httpx.Response(200, json={"deleted": True})
        if "session_id" in body:
            return self._session(body)
        return self._stateless(body)

    def _session(self, body: dict[str, Any]) -> httpx.Response:
        s = self.sessions[body["session_id"]]
        before = list(s["tokens"])
        if body["messages"][0]["role"] == "user":
            s["turn"], s["step"] = s["turn"] + 1, 0
            if s["rule"] == "template":  # the closed turns lose their reasoning
                s["tokens"] = [t for t in s["tokens"] if t[0] != "think"]
        s["step"] += 1
        for m in body["messages"]:
            s["tokens"].append((m["role"], s["turn"], USER if m["role"] == "user" else TOOL))
        prompt = sum(t[2] for t in s["tokens"])
        cached = _common(before, s["tokens"])
        s["tokens"] += [("think", s["turn"], THINK), ("out", s["turn"], OUT)]
        return self._answer(body, s["rule"], s["conv"], s["turn"], s["step"], prompt, cached)

    def _stateless(self, body: dict[str, Any]) -> httpx.Response:
        messages = body["messages"]
        conv = int(re.findall(r"case (\d+)", messages[0]["content"])[0])
        turn, step, tokens = 0, 0, [("sys", 0, SYSTEM)]
        for m in messages[1:]:
            if m["role"] == "user":
                turn, step = turn + 1, 0
                tokens.append(("user", turn, USER))
            elif m["role"] == "tool":
                tokens.append(("tool", turn, TOOL))
            else:
                step += 1
                tokens += [("think", turn, THINK)] if m.get("reasoning") else []
                tokens.append(("out", turn, OUT))
        prompt = sum(t[2] for t in tokens)
        key = (conv, body.get("cache_salt"))
        cached = _common(self.cache.get(key, []), tokens)
        self.cache[key] = [*tokens, ("think", turn, THINK), ("out", turn, OUT)]
        return self._answer(body, "stateless", conv, turn, step + 1, prompt, cached)

    def _answer(
        self,
        body: dict[str, Any],
        who: str,
        conv: int,
        turn: int,
        step: int,
        prompt: int,
        cached: int,
    ) -> httpx.Response:
        where = f"{conv}.{turn}.{step}"
        thought = f"thinking about {where}"
        if self.diverge == (who, turn, step):
            thought += " otherwise"
        self.ids += 1
        if body["tool_choice"] == "required":
            self.sent[-1]["call"] = f"call_{self.ids}"
            name = TOOLS[step % 2]["function"]["name"]
            deltas = [
                {
                    "tool_calls": [
                        {"index": 0, "id": f"call_{self.ids}", "function": {"name": name}}
                    ]
                },
                {"tool_calls": [{"index": 0, "function": {"arguments": '{"path": "a"}'}}]},
            ]
        else:
            deltas = [{"content": f"answer {where}"}]
        usage = {
            "prompt_tokens": prompt,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens": THINK + OUT,
            "completion_tokens_details": {"reasoning_tokens": THINK},
        }
        chunks = [
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            {"choices": [{"index": 0, "delta": {"reasoning": thought}}]},
            *({"choices": [{"index": 0, "delta": d}]} for d in deltas),
            {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
            {"choices": [], "usage": usage},
        ]
        return httpx.Response(200, content=_sse(chunks))


def _sse(chunks: list[dict[str, Any]]) -> Iterator[bytes]:
    for i, chunk in enumerate(chunks):
        if i == 1:
            time.sleep(DELAY)
        yield b"data: " + orjson.dumps(chunk) + b"\n\n"
    yield b"data: [DONE]\n\n"


def _clients(fake: Fake) -> dict[str, httpx.Client]:
    transport = httpx.MockTransport(fake)
    out = {"stateless": httpx.Client(base_url="http://vllm", transport=transport)}
    for mode, key in KEYS.items():
        headers = {"authorization": f"Bearer {key}"}
        out[mode] = httpx.Client(base_url="http://gateway", headers=headers, transport=transport)
    return out


def _run(fake: Fake) -> tuple[list[dict[str, Any]], dict]:
    return run(list(MODES), WORK, _clients(fake))


def test_each_mode_sends_what_its_rule_and_a_client_send() -> None:
    fake = Fake()
    records, errors = _run(fake)
    assert errors == {}
    creates = [s for s in fake.sent if s["path"] == "/v1/context"]
    assert len(creates) == 2 * 2  # a session per conversation and session mode
    rules = {s["auth"]: s["body"][RULE_FIELD] for s in creates}
    assert rules == {f"Bearer {KEYS['session-template']}": "template"} | {
        f"Bearer {KEYS['session-keep']}": "keep"
    }  # a tenant (an API key) each
    assert all(s["body"]["tools"] == TOOLS for s in creates)

    every = [s for s in fake.sent if s["path"] == "/v1/chat/completions"]
    chats = [s for s in every if "cache_salt" not in s["body"]]  # the measured requests
    assert len(chats) == 2 * TURNS * (CALLS + 1) * 3
    for s in chats:  # forced calls, one a request, then the text answer
        b = s["body"]
        assert b["tools"] == TOOLS and b["temperature"] == 0 and b["parallel_tool_calls"] is False
        assert b["tool_choice"] in ("required", "none") and b["stream"] is True
    assert all(s["host"] == "gateway" for s in chats if "session_id" in s["body"])
    mine = [s for s in chats if s["body"].get("session_id") == "ctx_0"]  # template, conv. 0
    first = [s["body"] for s in mine]
    assert [len(b["messages"]) for b in first] == [1, 1, 1] * TURNS  # only the new message
    assert first[0]["messages"] == [{"role": "user", "content": "question 0.0"}]
    assert first[0]["tool_choice"] == "required" and first[2]["tool_choice"] == "none"
    (tool,) = first[1]["messages"]
    assert tool["role"] == "tool" and tool["content"] == "result 0.0.0"
    assert tool["tool_call_id"] == mine[0]["call"]  # answering the call returned

    # stateless: no session, no key; the open turn's reasoning sent back, the closed ones' not
    stateless = [s for s in chats if s["host"] == "vllm"]
    assert all(s["auth"] is None and "session_id" not in s["body"] for s in stateless)
    last = stateless[TURNS * (CALLS + 1) - 1]["body"]["messages"]  # conversation 0's last
    turn = ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert [m["role"] for m in last] == ["system", *turn, *turn, *turn[:-1]]
    assistants = [(i, m) for i, m in enumerate(last) if m["role"] == "assistant"]
    last_user = max(i for i, m in enumerate(last) if m["role"] == "user")
    for i, m in assistants:
        assert ("reasoning" in m) == (i > last_user), (i, m)
    open_calls = [m for i, m in assistants if i > last_user]
    assert [m["reasoning"] for m in open_calls] == ["thinking about 0.3.1", "thinking about 0.3.2"]
    assert open_calls[0]["tool_calls"][0]["function"] == {
        "name": "run_command",
        "arguments": '{"path": "a"}',
    }
    assert last[-1]["tool_call_id"] == open_calls[-1]["tool_calls"][0]["id"]
    closed_answer = last[last_user - 1]
    assert closed_answer == {"role": "assistant", "content": "answer 0.2.3"}

    # each session step again, whole, to vLLM: the session's own conversation, as a client
    # sends it, with a salt of its own
    refs = [s for s in every if "cache_salt" in s["body"]]
    assert len(refs) == 2 * TURNS * (CALLS + 1) * 2 and all(s["host"] == "vllm" for s in refs)
    salts = {s["body"]["cache_salt"] for s in refs}
    assert salts == {"bench-reasoning-reference-session-template"} | {
        "bench-reasoning-reference-session-keep"
    }
    assert all("session_id" not in s["body"] and s["auth"] is None for s in refs)
    template_refs = [s["body"] for s in refs if s["body"]["cache_salt"].endswith("-template")]
    for b, sent in zip(template_refs, first, strict=False):  # conversation 0's
        assert b["messages"][-len(sent["messages"]) :] == sent["messages"]
        assert b["tool_choice"] == sent["tool_choice"]
    whole = template_refs[TURNS * (CALLS + 1) - 1]["messages"]
    assert [m["role"] for m in whole] == [m["role"] for m in last]
    assert [("reasoning" in m) for m in whole] == [("reasoning" in m) for m in last]

    steps = [r for r in records if r["kind"] != "create"]
    assert len(steps) == len(chats)
    for r in steps:  # the first reasoning delta, not the role chunk
        assert DELAY <= r["ttft_ms"] / 1e3 <= r["total_ms"] / 1e3
        assert r["recomputed_tokens"] == r["prompt_tokens"] - r["cached_tokens"]
        assert r["reasoning_tokens"] == THINK and r["finish_reason"] == "stop"
        if r["mode"] != "stateless":  # the same answers as the conversation sent whole
            assert r["same_answer"] is True and r["same_reasoning"] is True
    template = [r for r in steps if r["mode"] == "session-template"]
    ref = [r for r in steps if r["mode"] == "stateless"]
    assert all(r["same_prompt_tokens"] for r in template)  # the template's rendering
    later = [(r["turn"], r["step"]) != (1, 1) for r in ref]  # (the session's create prefilled)
    assert [r["cached_tokens"] for r, x in zip(template, later, strict=True) if x] == [
        r["cached_tokens"] for r, x in zip(ref, later, strict=True) if x
    ]
    keep = [r for r in steps if r["mode"] == "session-keep"]  # its context keeps the thinking
    assert [r["same_prompt_tokens"] for r in keep] == [r["turn"] == 1 for r in keep]


def test_rows_and_bounds_show_what_each_rule_recomputes_at_a_user_message(tmp_path: Path) -> None:
    records, _ = _run(Fake())
    modes = list(MODES)
    turns = {(t["turn"], t["mode"]): t for t in report.turns(records, modes, WORK)}
    closed = CALLS * (THINK + OUT) + (THINK + OUT) + CALLS * TOOL + USER  # with its thinking
    for u in range(2, TURNS + 1):
        t, k, s = (turns[(u, m)] for m in ("session-template", "session-keep", "stateless"))
        # template: the closed turn again, without its thinking, and the message
        assert t["recomputed_first"] == t["closed_turn_tokens"] == closed - (CALLS + 1) * THINK
        assert s["recomputed_first"] == t["recomputed_first"]  # a client's prefix cache: same
        # keep: only the message; its context holds every turn's thinking
        assert k["recomputed_first"] == k["new_tokens"] == USER
        assert k["context_first"] - t["context_first"] == (u - 1) * (CALLS + 1) * THINK
        assert t["same_answer"] == t["compared"] == 2 * (CALLS + 1)
        # the rest of the turn: the tool results only
        assert t["recomputed_turn"] == t["recomputed_first"] + CALLS * TOOL
    assert turns[(1, "session-keep")]["closed_turn_tokens"] is None
    summary = report.summary(records, modes, WORK)
    assert summary["session-template"]["recomputed_over_closed_turn_max"] == 0
    assert summary["session-keep"]["recomputed_over_new_tokens_max"] == 0
    assert summary["session-keep"]["first_difference"] is None

    rows = report.rows(records, modes, WORK)
    assert [(r["turn"], r["step"], r["kind"]) for r in rows] == [
        (u, s, k)
        for u in range(1, TURNS + 1)
        for s, k in ((1, "call 1"), (2, "call 2"), (3, "answer"))
    ]
    assert len(rows[0]["stateless"]["requests"]) == 2  # one per conversation
    meta = {"conversations": 2, "turns": TURNS, "calls": CALLS, "tool_tokens": TOOL}
    text = report.table(meta, rows, report.turns(records, modes, WORK), modes)
    assert "| 2 | session-keep |" in text and "closed turn + message" in text
    assert "| 2.1 (call 1) |" in text and "session-template = whole (prompt)" in text
    assert "| 6/6 (prompt 6) |" in text  # template, turn 2: both conversations, 3 steps each
    png = tmp_path / "reasoning.png"
    report.plot(png, records, modes, WORK, "fake")
    check_png(png)


def test_an_answer_unlike_the_whole_conversations_is_a_difference() -> None:
    records, _ = _run(Fake(diverge=("keep", 2, 2)))
    keep = [r for r in records if r["mode"] == "session-keep" and r["kind"] != "create"]
    at = {(r["conversation"], r["turn"], r["step"]): r for r in keep}
    assert at[(1, 2, 1)]["same_reasoning"] is True
    assert at[(1, 2, 2)]["same_reasoning"] is False and at[(1, 2, 2)]["same_answer"] is True
    assert at[(1, 2, 3)]["same_reasoning"] is True  # each step against its own reference
    summary = report.summary(records, list(MODES), WORK)
    assert summary["session-keep"]["first_difference"] == {"conversation": 1, "turn": 2, "step": 2}
    chains = summary["session-keep"]["after_tool_results"]
    assert (
        chains["compared"] == 2 * TURNS * CALLS
        and chains["same_reasoning"] == 2 * TURNS * CALLS - 2
    )
    users = summary["session-keep"]["at_user_messages"]
    assert users["compared"] == 2 * (TURNS - 1) and users["same_prompt_tokens"] == 0
    assert summary["session-template"]["first_difference"] is None
    assert summary["session-template"]["at_user_messages"]["same_prompt_tokens"] == 2 * (TURNS - 1)


def test_a_failing_mode_is_reported_and_the_others_go_on() -> None:
    fake = Fake()
    clients = _clients(fake)

    def refuse(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/context":
            return httpx.Response(400, json={"error": {"message": "no", "code": "bad"}})
        return fake(request)

    clients["session-keep"] = httpx.Client(
        base_url="http://gateway", transport=httpx.MockTransport(refuse)
    )
    records, errors = run(list(MODES), WORK, clients)
    assert set(errors) == {"session-keep"} and errors["session-keep"].startswith("400: ")
    assert not [r for r in records if r["mode"] == "session-keep"]
    assert len([r for r in records if r["mode"] == "stateless"]) == 2 * TURNS * (CALLS + 1)


@pytest.mark.slow  # a vLLM start and ~40 requests on 2 CPUs: `make test-slow`
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_quick_on_vllm_with_the_thinking_preset(tmp_path: Path, think_model: Path) -> None:
    require_vllm()
    out = tmp_path / "reasoning"
    eager = "--vllm-arg=--enforce-eager"  # (a loaded machine's compile can outlast the run)
    data = run_bench("reasoning", out, "--quick", "--model", str(think_model), eager)
    meta = data["meta"]
    assert meta["errors"] == {} and meta["reasoning_parser"] == "qwen3"
    assert meta["vllm_dtype"] == "float32"
    rows = data["results"]
    assert [(r["turn"], r["step"]) for r in rows] == [(u, s) for u in (1, 2, 3) for s in (1, 2)]
    for r in rows:
        for mode in MODES:
            assert r[mode]["reasoning_tokens"] > 0 and r[mode]["ttft_ms"] > 0
    per_turn = {(t["turn"], t["mode"]): t for t in meta["per_turn"]}
    for u in (2, 3):  # keep's context holds the closed turns' thinking, template's does not
        keep, template = per_turn[(u, "session-keep")], per_turn[(u, "session-template")]
        assert keep["context_first"] > template["context_first"]
    summary = meta["summary"]
    block = summary["block_tokens"]
    assert summary["session-template"]["recomputed_over_closed_turn_max"] < block
    assert summary["session-keep"]["recomputed_over_new_tokens_max"] < block
    # after a new user message, the default rule answers as the whole conversation sent
    # without a session, from the same prompt
    users = summary["session-template"]["at_user_messages"]
    assert users["compared"] == 2 and users["same_answer"] == users["same_prompt_tokens"] == 2
