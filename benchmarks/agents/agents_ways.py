"""The four ways `ctxcache bench agents` runs its loop, their streams, and the rounds."""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from benchmarks.agents.agents import NAME, TOOLS, USER, WAYS, Workload


@dataclass
class Call:
    id: str = ""
    name: str = ""
    arguments: str = ""


@dataclass
class Answer:
    """One streamed request: its timing, the calls it returned, its usage."""

    ttft_s: float = 0.0
    total_s: float = 0.0
    calls: list[Call] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    request_bytes: int = 0
    response_id: str | None = None


class WayFailed(RuntimeError):
    """A request of a way failed: what was sent and what came back."""

    def __init__(self, sent: bytes, status: int, body: str) -> None:
        super().__init__(f"{status}: {body[:2000]} (sent {sent[:2000]!r})")
        self.sent, self.status, self.body = sent, status, body


def stream(
    client: Any, path: str, body: dict[str, Any], read: Callable[[Answer, dict[str, Any]], bool]
) -> Answer:
    """POST `body` to `path` of `client` (an httpx.Client) and read its SSE `data:` events
    with `read(answer, event)`, true for an event that carries the answer's first content
    or tool-call delta: the TTFT (the whole time when none came)."""
    data = orjson.dumps(body)
    answer = Answer(request_bytes=len(data))
    t0 = time.perf_counter()
    with client.stream("POST", path, content=data) as r:
        if r.status_code != 200:
            r.read()
            raise WayFailed(data, r.status_code, r.text)
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            if "error" in event and not event.get("type", "").startswith("response."):
                raise WayFailed(data, r.status_code, line)
            if read(answer, event) and not answer.ttft_s:
                answer.ttft_s = time.perf_counter() - t0
    answer.total_s = time.perf_counter() - t0
    answer.ttft_s = answer.ttft_s or answer.total_s
    return answer


def read_chat(answer: Answer, chunk: dict[str, Any]) -> bool:
    """A chat completion chunk: text, tool-call deltas (by index), usage."""
    first = False
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if delta.get("content"):
            answer.text += delta["content"]
            first = True
        for d in delta.get("tool_calls") or []:
            first = True
            while len(answer.calls) <= int(d.get("index") or 0):
                answer.calls.append(Call())
            call = answer.calls[int(d.get("index") or 0)]
            fn = d.get("function") or {}
            call.id = d.get("id") or call.id
            call.name = fn.get("name") or call.name
            call.arguments += fn.get("arguments") or ""
    if usage := chunk.get("usage"):
        answer.prompt_tokens = usage.get("prompt_tokens")
        answer.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        answer.completion_tokens = usage.get("completion_tokens")
    return first


def read_responses(answer: Answer, event: dict[str, Any]) -> bool:
    """A Responses event: function calls when their items are done; usage and the id from
    `response.completed` (or `.incomplete`)."""
    kind = str(event.get("type") or "")
    if kind in ("response.failed", "error"):
        raise WayFailed(b"", 200, orjson.dumps(event).decode())
    item = event.get("item") or {}
    if kind == "response.output_item.done" and item.get("type") == "function_call":
        answer.calls.append(Call(item["call_id"], item["name"], item["arguments"]))
    if kind == "response.output_text.delta":
        answer.text += event.get("delta") or ""
    if kind in ("response.completed", "response.incomplete"):
        response = event["response"]
        answer.response_id = response["id"]
        usage = response.get("usage") or {}
        answer.prompt_tokens = usage.get("input_tokens")
        answer.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        answer.completion_tokens = usage.get("output_tokens")
    return kind == "response.output_item.added" or kind.endswith(".delta")


# ---- the ways: one object per loop -----------------------------------------------------
class Loop:
    """One agent loop of one way: `begin()` (the seconds it took, 0 if nothing), then
    `step(k)` for k = 0 .. work.requests - 1, then `end()`."""

    name = ""

    def __init__(self, client: Any, work: Workload, task: int) -> None:
        self.client, self.work, self.task = client, work, task
        self.calls: list[Call] = []

    def begin(self) -> float:
        return 0.0

    def end(self) -> None:
        return None

    def sampling(self, k: int) -> dict[str, Any]:
        return {
            "model": self.work.model,
            "tools": TOOLS,
            "tool_choice": self.work.tool_choice(k),
            "max_tokens": self.work.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def new_messages(self, k: int) -> list[dict[str, Any]]:
        """The user message first; then a tool message answering each call returned."""
        if k == 0:
            return [{"role": "user", "content": USER}]
        if not self.calls:
            raise WayFailed(b"", 200, f"{self.name}: step {k} returned no tool call")
        return tool_messages(self.calls, self.work.results[k - 1])

    def answered(self, answer: Answer, k: int) -> Answer:
        """The answer, once a forced step's is a whole call (a call cut at max_tokens has
        arguments that are not JSON: the next step would answer a broken call)."""
        if k < self.work.steps and not whole_calls(answer):
            raise WayFailed(
                b"", 200, f"{self.name}: step {k + 1} forced a call, got {answer} (--max-tokens?)"
            )
        self.calls = answer.calls
        return answer


def whole_calls(answer: Answer) -> bool:
    """Whether the answer is one or more whole calls (an id, a name, JSON arguments)."""
    return bool(answer.calls) and all(map(_whole, answer.calls))


def _whole(call: Call) -> bool:
    try:
        return bool(call.id and call.name) and isinstance(orjson.loads(call.arguments), dict)
    except orjson.JSONDecodeError:
        return False


def tool_messages(calls: list[Call], result: str) -> list[dict[str, Any]]:
    """A `tool` message answering each call with `result`."""
    return [{"role": "tool", "tool_call_id": c.id, "content": result} for c in calls]


def assistant_message(answer: Answer) -> dict[str, Any]:
    """The answer as the assistant message a client resends: its text, its calls."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.text or None}
    if answer.calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in answer.calls
        ]
    return message


class SessionLoop(Loop):
    name = "session"

    def begin(self) -> float:
        system = {"role": "system", "content": self.work.system(self.task)}
        body = {"model": self.work.model, "messages": [system], "tools": TOOLS, "ttl": 3600}
        data = orjson.dumps(body)
        t0 = time.perf_counter()
        r = self.client.post("/v1/context", content=data)
        if r.status_code != 200:
            raise WayFailed(data, r.status_code, r.text)
        self.session_id = str(r.json()["session_id"])
        return time.perf_counter() - t0

    def step(self, k: int) -> Answer:
        body = {**self.sampling(k), "session_id": self.session_id}
        body["messages"] = self.new_messages(k)
        return self.answered(stream(self.client, "/v1/chat/completions", body, read_chat), k)

    def end(self) -> None:
        self.client.delete(f"/v1/context/{self.session_id}")


class StatelessLoop(Loop):
    name = "stateless"

    def begin(self) -> float:
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": self.work.system(self.task)}
        ]
        return 0.0

    def step(self, k: int) -> Answer:
        self.messages += self.new_messages(k)
        body = {**self.sampling(k), "messages": self.messages}
        answer = self.answered(stream(self.client, "/v1/chat/completions", body, read_chat), k)
        self.messages.append(assistant_message(answer))
        return answer


class StatelessGatewayLoop(StatelessLoop):
    """`stateless`'s requests, sent to the gateway (no `session_id`)."""

    name = "stateless-gateway"


class ResponsesLoop(Loop):
    name = "responses"
    previous: str | None = None

    def step(self, k: int) -> Answer:
        choice = self.work.tool_choice(k)
        if isinstance(choice, dict):  # Responses' named choice: no `function` wrapper
            choice = {"type": "function", "name": choice["function"]["name"]}
        items: list[dict[str, Any]] = [
            {"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]}
            if m["role"] == "tool"
            else m
            for m in self.new_messages(k)
        ]
        body: dict[str, Any] = {
            "model": self.work.model,
            "instructions": self.work.system(self.task),
            "input": items,
            "tools": [{"type": "function", **t["function"]} for t in TOOLS],
            "tool_choice": choice,
            "max_output_tokens": self.work.max_tokens,
            "temperature": 0,
            "stream": True,
        }
        if self.previous is not None:
            body["previous_response_id"] = self.previous
        answer = self.answered(stream(self.client, "/v1/responses", body, read_responses), k)
        self.previous = answer.response_id
        return answer


LOOPS: dict[str, type[Loop]] = {
    "session": SessionLoop,
    "stateless": StatelessLoop,
    "responses": ResponsesLoop,
    "stateless-gateway": StatelessGatewayLoop,
}


# ---- the rounds ------------------------------------------------------------------------
def run(
    args: argparse.Namespace,
    ways: list[str],
    work: Workload,
    *,
    gateway: str,
    engine: str,
    sup: Any = None,
    clients: dict[str, Any] | None = None,
    metrics: Callable[[], dict[str, float]] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """`--warmup` then `--rounds` rounds, each one loop of every way, step by step in turn:
    one record per request (and per session create), and the error of each way that failed
    (it is left out from then on). `metrics`: vLLM's counters (`kvpath_vllm.scrape`), read
    around each request: one request at a time, so their deltas are that request's."""
    import httpx
    from tqdm import tqdm

    if clients is None:
        headers = {"content-type": "application/json"}
        clients = {
            url: httpx.Client(base_url=url, headers=headers, timeout=900)
            for url in (gateway, engine)
        }
    client = {w: clients[gateway] for w in ("session", "responses", "stateless-gateway")}
    client["stateless"] = clients[engine]
    stopping = sup.stopping if sup is not None else threading.Event()
    records: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    rounds = args.warmup + args.rounds
    with tqdm(total=rounds * len(ways) * work.requests, desc=NAME, unit="req") as bar:
        for r in range(rounds):
            counted = r - args.warmup  # negative: a warm-up round
            live = [w for w in ways if w not in errors]
            loops = {w: LOOPS[w](client[w], work, task=r * len(WAYS) + WAYS.index(w)) for w in live}
            for k in range(-1, work.requests):  # -1: each loop's begin (the session's create)
                if stopping.is_set():
                    raise KeyboardInterrupt
                turn = (r * work.requests + k) % len(live) if live else 0
                for way in live[turn:] + live[:turn]:
                    if way in errors:
                        continue
                    try:
                        before = metrics() if metrics is not None else {}
                        record = _request(loops[way], k)
                        if record is not None and metrics is not None:
                            record |= _engine(before, metrics())
                    except (WayFailed, httpx.HTTPError) as exc:
                        errors[way] = str(exc)
                        bar.write(f"{way} failed at round {r + 1} step {k + 1}: {exc}")
                        continue
                    if k >= 0:
                        bar.update(1)
                    if counted >= 0 and record is not None:
                        records.append({"round": counted + 1, "way": way, **record})
                if k >= 0 and counted >= 0:
                    bar.write(_progress_line(records, counted + 1, k + 1))
            for way, loop in loops.items():
                if way not in errors:
                    loop.end()
    return records, errors


def _request(loop: Loop, k: int) -> dict[str, Any] | None:
    if k < 0:
        seconds = loop.begin()
        return {"step": 0, "kind": "create", "total_ms": seconds * 1e3} if seconds else None
    a = loop.step(k)
    return {
        "step": k + 1,
        "kind": "call" if k < loop.work.steps else "answer",
        "ttft_ms": a.ttft_s * 1e3,
        "total_ms": a.total_s * 1e3,
        "prompt_tokens": a.prompt_tokens,
        "cached_tokens": a.cached_tokens,
        "completion_tokens": a.completion_tokens,
        "request_bytes": a.request_bytes,
        "calls": [c.name for c in a.calls],
    }


def _engine(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What vLLM says of the request: its own TTFT (queue, prefill, first token), its
    prefill time, and the tokens the connector loaded from the sidecar."""
    keys = ("engine_ttft_ms", "prefill_ms", "loaded_tokens")
    return {k: round(after.get(k, 0.0) - before.get(k, 0.0), 3) for k in keys}


def _progress_line(records: list[dict[str, Any]], rnd: int, step: int) -> str:
    cells = [
        f"{r['way']} {r['ttft_ms']:,.0f} ms (cached {r['cached_tokens']}/{r['prompt_tokens']})"
        for r in records
        if r["round"] == rnd and r["step"] == step
    ]
    return f"round {rnd} step {step}: " + ", ".join(cells)
