"""The modes of `ctxcache bench reasoning`: what each sends a step, the reference each
session mode's answer is compared with, and the run that steps them side by side."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from benchmarks.agents.agents import TOOLS
from benchmarks.agents.agents_ways import Answer, WayFailed, read_chat, stream
from benchmarks.reasoning.reasoning import NAME, REFERENCE, Workload

# the session setting of each session mode (`POST /v1/context`)
RULE_FIELD = "reasoning_history"
RULES = {"session-template": "template", "session-keep": "keep"}


@dataclass
class Thinking:
    """What a streamed chat answer carries beside `Answer`: its reasoning (the field vLLM's
    parser gives it), the reasoning tokens of its usage and its finish reason."""

    reasoning: str = ""
    reasoning_tokens: int | None = None
    finish_reason: str | None = None
    answer: Answer = field(default_factory=Answer)

    def read(self, answer: Answer, chunk: dict[str, Any]) -> bool:
        """`read_chat`, and the reasoning: true for a chunk with the first reasoning,
        content or tool-call delta (the TTFT: a thinking model's first token is thought)."""
        first = read_chat(answer, chunk)
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            piece = delta.get("reasoning") or delta.get("reasoning_content")
            if piece:
                self.reasoning += piece
                first = True
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        details = (chunk.get("usage") or {}).get("completion_tokens_details") or {}
        if details.get("reasoning_tokens") is not None:
            self.reasoning_tokens = int(details["reasoning_tokens"])
        return first

    def key(self) -> str:
        """The answer as compared between modes: content and tool calls (not their ids)."""
        calls = [[c.name, c.arguments] for c in self.answer.calls]
        return _digest([self.answer.text, calls])


def _digest(value: Any) -> str:
    return hashlib.sha256(orjson.dumps(value)).hexdigest()[:16]


# ---- one conversation of one mode ----------------------------------------------------------
class History:
    """A conversation as an OpenAI client keeps it and sends it whole: the assistant
    messages with their `reasoning` while their user turn is open, without it once the next
    user message is sent (the closed turns' thinking is not sent again)."""

    def __init__(self, system: str) -> None:
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}]

    def send(self, new: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The whole conversation with the `new` messages: what the client sends now."""
        if new and new[0]["role"] == "user":
            for m in self.messages:
                m.pop("reasoning", None)
        self.messages += new
        return orjson.loads(orjson.dumps(self.messages))  # (a copy: this request's)

    def answered(self, thinking: Thinking) -> None:
        answer = thinking.answer
        message: dict[str, Any] = {"role": "assistant", "content": answer.text or None}
        if answer.calls:
            message["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in answer.calls
            ]
        if thinking.reasoning:
            message["reasoning"] = thinking.reasoning
        self.messages.append(message)


class Conversation:
    """One conversation of a mode: `begin()` (the seconds it took, 0 if nothing), then
    `step(u, s)` for each user turn u and its steps s, then `end()`."""

    name = ""

    def __init__(self, client: Any, work: Workload, index: int) -> None:
        self.client, self.work, self.index = client, work, index
        self.last: Thinking | None = None
        self.history = History(work.system(index))

    def begin(self) -> float:
        return 0.0

    def end(self) -> None:
        return None

    def body(self, step: int) -> dict[str, Any]:
        return {
            "model": self.work.model,
            "tools": TOOLS,
            "tool_choice": self.work.tool_choice(step),
            "parallel_tool_calls": False,
            "max_tokens": self.work.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def new_messages(self, turn: int, step: int) -> list[dict[str, Any]]:
        """The user message first; then a tool message answering each call returned."""
        if step == 0:
            return [{"role": "user", "content": self.work.users[self.index][turn]}]
        calls = self.last.answer.calls if self.last is not None else []
        if not calls:
            raise WayFailed(b"", 200, f"{self.name}: turn {turn + 1} step {step} gave no call")
        result = self.work.results[self.index][turn][step - 1]
        return [{"role": "tool", "tool_call_id": c.id, "content": result} for c in calls]

    def send(self, body: dict[str, Any], step: int) -> Thinking:
        """Stream `body`; the answer, once a forced step's is a whole call (a call cut at
        max_tokens is not JSON: the next step would answer a broken call)."""
        thinking = chat(self.client, body)
        calls = thinking.answer.calls
        if step < self.work.calls and not (calls and all(map(_whole, calls))):
            raise WayFailed(b"", 200, f"{self.name}: a forced call, got {thinking} (--max-tokens?)")
        self.last = thinking
        return thinking


def chat(client: Any, body: dict[str, Any]) -> Thinking:
    thinking = Thinking()
    thinking.answer = stream(client, "/v1/chat/completions", body, thinking.read)
    return thinking


def _whole(call: Any) -> bool:
    try:
        return bool(call.id and call.name) and isinstance(orjson.loads(call.arguments), dict)
    except orjson.JSONDecodeError:
        return False


class SessionConversation(Conversation):
    """A session created with `rule`; each step only the new messages. `reference()`: the
    same conversation (this session's answers so far), sent whole to vLLM as a client
    sends it, with a `cache_salt` of its own (it warms nothing that is measured)."""

    def __init__(self, client: Any, engine: Any, work: Workload, index: int, name: str) -> None:
        super().__init__(client, work, index)
        self.engine, self.name, self.rule = engine, name, RULES[name]
        self.sent: list[dict[str, Any]] = []

    def begin(self) -> float:
        import time

        system = self.history.messages[0]
        body = {"model": self.work.model, "messages": [system], "tools": TOOLS, "ttl": 3600}
        data = orjson.dumps({**body, RULE_FIELD: self.rule})
        t0 = time.perf_counter()
        r = self.client.post("/v1/context", content=data)
        if r.status_code != 200:
            raise WayFailed(data, r.status_code, r.text)
        self.session_id = str(r.json()["session_id"])
        return time.perf_counter() - t0

    def step(self, turn: int, step: int) -> Thinking:
        new = self.new_messages(turn, step)
        self.sent = self.history.send(new)
        body = {**self.body(step), "session_id": self.session_id, "messages": new}
        thinking = self.send(body, step)
        self.history.answered(thinking)
        return thinking

    def reference(self, step: int) -> Thinking:
        """vLLM's answer to the conversation the last step continued, sent whole."""
        salt = f"bench-reasoning-reference-{self.name}"
        return chat(self.engine, {**self.body(step), "messages": self.sent, "cache_salt": salt})

    def end(self) -> None:
        self.client.delete(f"/v1/context/{self.session_id}")


class StatelessConversation(Conversation):
    """The whole conversation each step, as a client keeps it (`History`)."""

    name = REFERENCE

    def step(self, turn: int, step: int) -> Thinking:
        messages = self.history.send(self.new_messages(turn, step))
        thinking = self.send({**self.body(step), "messages": messages}, step)
        self.history.answered(thinking)
        return thinking


def conversation(mode: str, clients: dict[str, Any], work: Workload, index: int) -> Conversation:
    if mode == REFERENCE:
        return StatelessConversation(clients[mode], work, index)
    return SessionConversation(clients[mode], clients[REFERENCE], work, index, mode)


# ---- the run -------------------------------------------------------------------------------
def run(
    modes: list[str],
    work: Workload,
    clients: dict[str, Any],
    *,
    sup: Any = None,
    metrics: Callable[[], dict[str, float]] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Every conversation, one after another; in each, step by step, every mode in turn
    (the order rotating every step), each session mode's step followed by its reference
    (not timed). One record per request (and per session create), and the error of each
    mode that failed (left out from then on). `clients`: an httpx client per mode (its base
    URL and API key), and `stateless`'s (vLLM) always: the references go there. `metrics`:
    vLLM's counters, read around each measured request (one at a time, so their deltas are
    that request's)."""
    import httpx
    from tqdm import tqdm

    stopping = sup.stopping if sup is not None else threading.Event()
    records: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    total = work.conversations * work.turns * work.steps * len(modes)
    order = 0
    with tqdm(total=total, desc=NAME, unit="req") as bar:
        for c in range(work.conversations):
            convs = {m: conversation(m, clients, work, c) for m in modes if m not in errors}
            for mode, conv in list(convs.items()):
                try:
                    seconds = conv.begin()
                except (WayFailed, httpx.HTTPError) as exc:
                    errors[mode] = str(exc)
                    bar.write(f"{mode} failed at its create: {exc}")
                    continue
                if seconds:
                    records.append(_create(c, mode, seconds))
            for u in range(work.turns):
                for s in range(work.steps):
                    if stopping.is_set():
                        raise KeyboardInterrupt
                    live = [m for m in convs if m not in errors]
                    k = order % len(live) if live else 0
                    order += 1
                    step: dict[str, dict[str, Any]] = {}
                    for mode in live[k:] + live[:k]:
                        conv = convs[mode]
                        try:
                            before = metrics() if metrics is not None else {}
                            thinking = conv.step(u, s)
                            after = metrics() if metrics is not None else {}
                            ref = (
                                conv.reference(s) if isinstance(conv, SessionConversation) else None
                            )
                        except (WayFailed, httpx.HTTPError) as exc:
                            errors[mode] = str(exc)
                            bar.write(f"{mode} failed at conversation {c + 1} turn {u + 1}: {exc}")
                            continue
                        step[mode] = _record(c, u, s, mode, work, thinking, before, after)
                        step[mode] |= _compare(thinking, ref)
                        bar.update(1)
                    records += [step[m] for m in modes if m in step]
                bar.write(_progress_line(records, c + 1, u + 1))
            for mode, conv in convs.items():
                if mode not in errors:
                    conv.end()
    return records, errors


def _create(c: int, mode: str, seconds: float) -> dict[str, Any]:
    where = {"conversation": c + 1, "turn": 0, "step": 0}
    return {**where, "kind": "create", "mode": mode, "total_ms": seconds * 1e3}


def _record(
    c: int,
    u: int,
    s: int,
    mode: str,
    work: Workload,
    t: Thinking,
    before: dict[str, float],
    after: dict[str, float],
) -> dict[str, Any]:
    a = t.answer
    recomputed = None
    if a.prompt_tokens is not None and a.cached_tokens is not None:
        recomputed = a.prompt_tokens - a.cached_tokens
    keys = ("engine_ttft_ms", "prefill_ms", "loaded_tokens")
    return {
        "conversation": c + 1,
        "turn": u + 1,
        "step": s + 1,
        "kind": "call" if s < work.calls else "answer",
        "mode": mode,
        "ttft_ms": a.ttft_s * 1e3,
        "total_ms": a.total_s * 1e3,
        "prompt_tokens": a.prompt_tokens,
        "cached_tokens": a.cached_tokens,
        "recomputed_tokens": recomputed,
        "completion_tokens": a.completion_tokens,
        "reasoning_tokens": t.reasoning_tokens,
        "reasoning_chars": len(t.reasoning),
        "content_chars": len(a.text),
        "calls": [c.name for c in a.calls],
        "arguments": [c.arguments for c in a.calls],
        "finish_reason": t.finish_reason,
        "answer": t.key(),
        "reasoning": _digest(t.reasoning),
        **{k: round(after.get(k, 0.0) - before.get(k, 0.0), 3) for k in keys if k in after},
    }


def _compare(thinking: Thinking, ref: Thinking | None) -> dict[str, Any]:
    """A session mode's answer against vLLM's to the same conversation sent whole:
    `same_answer` (content and tool calls), `same_reasoning`, `same_prompt_tokens` (the
    session's context against the client's rendering), the reference's prompt tokens."""
    if ref is None:
        return {}
    return {
        "same_answer": thinking.key() == ref.key(),
        "same_reasoning": thinking.reasoning == ref.reasoning,
        "same_prompt_tokens": thinking.answer.prompt_tokens == ref.answer.prompt_tokens,
        "reference_prompt_tokens": ref.answer.prompt_tokens,
    }


def _progress_line(records: list[dict[str, Any]], conv: int, turn: int) -> str:
    cells = [
        f"{r['mode']} ctx {r['prompt_tokens']} recomputed {r['recomputed_tokens']} "
        f"{r['ttft_ms']:,.0f} ms" + ("" if r.get("same_answer") in (None, True) else " (differs)")
        for r in records
        if (r["conversation"], r["turn"], r["step"]) == (conv, turn, 1)
    ]
    return f"conversation {conv} turn {turn}, its first step: " + ", ".join(cells)
