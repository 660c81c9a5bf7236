"""What `ctxcache bench implicit-routing` sends and reads: one streamed chat request through
the gateway, timed, and the worker that served it (`Served`, from the workers' own
counters), a conversation's turns (`Conversation`), and the gateway's implicit counts
and in-flight gauges. See benchmarks/gateway/implicit_routing.py."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from benchmarks.lib.util import ChatStream

IMPLICIT = "ctxcache_gateway_implicit_total"
RESULTS = ("shared", "hit", "branch", "miss", "passed", "unkept")
PROMPT = "ctxcache_worker_prompt_tokens_total"
CACHED = "ctxcache_worker_cached_tokens_total"
TIERS = ("l1", "sidecar")

Message = dict[str, Any]


def samples(text: str, name: str) -> dict[str, float]:
    """Prometheus samples of `name` by their labels' text ("" without labels)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            head, value = line.rsplit(" ", 1)
            out[head[len(name) :].strip("{}")] = float(value)
    return out


def label(labels: str, key: str) -> str:
    return labels.split(f'{key}="', 1)[1].split('"', 1)[0] if f'{key}="' in labels else ""


@dataclass(frozen=True)
class Counters:
    """One worker's prompt tokens and reused tokens by tier, at one moment."""

    prompt: float
    cached: dict[str, float]


class Workers:
    """The stack's workers, by the gateway's name for each (`w0`, `w1`), read from their own
    /metrics: the worker whose prompt-token counter moved over a request served it."""

    def __init__(self, urls: dict[str, str]) -> None:
        self.clients = {
            name: httpx.AsyncClient(base_url=url, timeout=30) for name, url in urls.items()
        }

    async def aclose(self) -> None:
        for client in self.clients.values():
            await client.aclose()

    async def counters(self) -> dict[str, Counters]:
        async def one(client: httpx.AsyncClient) -> Counters:
            text = (await client.get("/metrics")).text
            cached = {label(k, "tier"): v for k, v in samples(text, CACHED).items()}
            return Counters(samples(text, PROMPT).get("", 0.0), cached)

        got = await asyncio.gather(*(one(c) for c in self.clients.values()))
        return dict(zip(self.clients, got, strict=True))


@dataclass
class Served:
    """One request's answer: its time to the first content token and whole time (s), its
    usage, the worker that prefilled it and the reused tokens that worker counted by tier."""

    ttft_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    worker: str  # "?" where no worker or both counted a prompt meanwhile
    tiers: dict[str, int] = field(default_factory=dict)
    result: str = "?"  # what the gateway's implicit sessions made of it (its counter's move)


def moved(before: dict[str, Counters], after: dict[str, Counters]) -> tuple[str, dict[str, int]]:
    """Which worker counted a prompt between the two readings, and its reused tokens."""
    grew = [w for w in after if after[w].prompt > before[w].prompt]
    if len(grew) != 1:
        return "?", {}
    (w,) = grew
    tiers = {t: int(after[w].cached.get(t, 0) - before[w].cached.get(t, 0)) for t in TIERS}
    return w, tiers


async def stream(
    client: httpx.AsyncClient, body: dict[str, Any]
) -> tuple[str, float, float, dict[str, Any]]:
    """POST a streamed chat body: the answer's text, TTFT, whole time and usage chunk."""
    reading = ChatStream()
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"chat answered {r.status_code}: {r.text[:500]}")
        async for line in r.aiter_lines():
            reading.line(line)
    return reading.result()


@dataclass
class Conversation:
    """A client that never sends `session_id`: the whole conversation every request."""

    name: str
    system: str
    questions: list[str]  # its first question, then one per later turn
    key: str | None = None  # its `prompt_cache_key`
    messages: list[Message] = field(default_factory=list)

    def body(self, model: str, turn: int, max_tokens: int) -> dict[str, Any]:
        if turn == 0:
            self.messages = [{"role": "system", "content": self.system}]
        self.messages.append({"role": "user", "content": self.questions[turn]})
        body: dict[str, Any] = {
            "model": model,
            "messages": list(self.messages),
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.key is not None:
            body["prompt_cache_key"] = self.key
        return body

    def answered(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})


class Client:
    """The bench's client of one stack: the gateway and its workers' counters."""

    def __init__(self, gateway: str, api_key: str, model: str, workers: dict[str, str]) -> None:
        headers = {"authorization": f"Bearer {api_key}"}
        self.gateway = httpx.AsyncClient(base_url=gateway, headers=headers, timeout=600)
        self.model = model
        self.workers = Workers(workers)

    async def aclose(self) -> None:
        await self.gateway.aclose()
        await self.workers.aclose()

    async def send(self, conv: Conversation, turn: int, max_tokens: int) -> Served:
        """Turn `turn` of `conv`, alone in flight on the workers' prompts and in the
        gateway's implicit counts: the worker whose prompt counter moved served it, and the
        result whose count moved is what the gateway made of it."""
        counted = await self.implicit()
        before = await self.workers.counters()
        text, ttft, total, usage = await stream(
            self.gateway, conv.body(self.model, turn, max_tokens)
        )
        after = await self.workers.counters()
        now = await self.implicit()
        conv.answered(text)
        worker, tiers = moved(before, after)
        details = usage.get("prompt_tokens_details") or {}
        prompt, cached = int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens") or 0)
        result = "+".join(r for r in RESULTS if now[r] > counted[r]) or "?"
        return Served(ttft, total, prompt, cached, worker, tiers, result)

    async def warm_up(self) -> None:
        """One short request straight to each worker (its first forward pass is slow), not
        through the gateway: nothing of it counts, or is cached for the workload."""
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Warm up."}],
            "max_tokens": 4,
        }
        for client in self.workers.clients.values():
            r = await client.post("/v1/chat/completions", json=body)
            r.raise_for_status()

    async def metrics(self) -> str:
        return (await self.gateway.get("/metrics")).text

    async def implicit(self) -> dict[str, int]:
        """`ctxcache_gateway_implicit_total` by result."""
        got = {
            label(k, "result"): int(v) for k, v in samples(await self.metrics(), IMPLICIT).items()
        }
        return {r: got.get(r, 0) for r in RESULTS}

    async def inflight(self) -> dict[str, int]:
        """The gateway's requests in flight per worker."""
        got = samples(await self.metrics(), "ctxcache_gateway_worker_inflight")
        return {label(k, "worker"): int(v) for k, v in got.items()}

    async def wait_workers(self, names: list[str], within_s: float = 120.0) -> None:
        """Until the gateway counts every worker healthy (its health loop's next pass)."""
        deadline = time.monotonic() + within_s
        while True:
            got = samples(await self.metrics(), "ctxcache_gateway_worker_healthy")
            if all(got.get(f'worker="{n}"') == 1.0 for n in names):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway does not count {names} healthy: {got}")
            await asyncio.sleep(0.2)


class Busy:
    """Long streams that keep one worker busy (`start`) until `stop`: each a new
    conversation with a `prompt_cache_key` that hashes to that worker."""

    def __init__(self, client: Client, key: str, n: int, max_tokens: int) -> None:
        self.client, self.key, self.n, self.max_tokens = client, key, n, max_tokens
        self.tasks: list[asyncio.Task[None]] = []
        self.started: list[asyncio.Event] = []

    async def start(self, within_s: float = 120.0) -> None:
        """Every stream sent, and each at its first token (its prefill done: the workers'
        prompt counters move no more for it)."""
        for i in range(self.n):
            seen = asyncio.Event()
            self.started.append(seen)
            self.tasks.append(asyncio.create_task(self._one(i, seen)))
        deadline = time.monotonic() + within_s
        while not all(e.is_set() for e in self.started):
            ended = [t for t in self.tasks if t.done()]
            if ended:  # (a stream that ends before the others start: an error, or too short)
                error = ended[0].exception()
                raise RuntimeError(f"a busy stream ended early: {error or 'done'}")
            if time.monotonic() > deadline:
                raise RuntimeError("the busy streams did not start in time")
            await asyncio.sleep(0.05)

    async def _one(self, i: int, seen: asyncio.Event) -> None:
        body = {
            "model": self.client.model,
            "messages": [{"role": "user", "content": f"Count slowly, stream {i}."}],
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "prompt_cache_key": self.key,
        }
        async with self.client.gateway.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                raise RuntimeError(f"busy stream answered {r.status_code}: {r.text[:300]}")
            async for line in r.aiter_lines():
                if seen.is_set() or not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = orjson.loads(line[6:]).get("choices") or [{}]
                if (choices[0].get("delta") or {}).get("content"):
                    seen.set()

    async def stop(self) -> list[bool]:
        """Cancel the streams (the gateway cancels them on the worker); whether each was
        still running (so the worker was still busy for everything sent meanwhile)."""
        running = [not t.done() for t in self.tasks]
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        return running
