"""The load of `ctxcache bench load`: one session's create and turns, each request with the
documented retries (`Load`), and the check of a stored history against what its client was
answered (`history_problems`). See benchmarks/load/load.py."""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from benchmarks.load.load_stack import Sampler

log = logging.getLogger("ctxcache.bench.load")

RETRY = (409, 429, 503)
LONG_TTL = 3600
WORDS = ["cache", "token", "session", "prefix", "history", "worker", "block", "chunk"]


# -- the load ---------------------------------------------------------------------------------
@dataclass
class TurnResult:
    prompt_tokens: int
    completion_tokens: int
    context_tokens: int  # the session's, after this turn
    seconds: float
    index: int


@dataclass
class Load:
    args: argparse.Namespace
    client: httpx.AsyncClient
    model: str
    sampler: Sampler
    statuses: Counter[int | str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    retried: int = 0

    def fail(self, what: str) -> None:
        self.failures.append(what)
        if len(self.failures) <= 10:
            log.error("%s", what)

    async def call(self, method: str, url: str, body: Any = None, stream: bool = False) -> Any:
        """One request with the documented retries; the JSON answer (or the final usage
        chunk's, when streaming), or None after an unexpected status."""
        for attempt in range(self.args.max_retries + 1):
            self.sampler.inflight += 1
            try:
                status, payload, headers = await self._send(method, url, body, stream)
            except httpx.TransportError as exc:  # not retried: a turn may have committed
                self.statuses[f"{type(exc).__name__}"] += 1
                self.fail(f"{method} {url}: {type(exc).__name__} {exc}")
                return None
            finally:
                self.sampler.inflight -= 1
            error = payload.get("error") if isinstance(payload, dict) else None
            code = error.get("code") if isinstance(error, dict) else None
            self.statuses[f"{status} {code}" if code else status] += 1
            if status < 400:
                return payload
            if status not in RETRY or attempt == self.args.max_retries:
                self.fail(f"{method} {url}: {status} {str(payload)[:200]}")
                return None
            self.retried += 1
            wait_ms = int(headers.get("retry-after-ms") or 0) or 50 * 2 ** min(attempt, 5)
            await asyncio.sleep(min(wait_ms, 2000) / 1000 * random.uniform(0.5, 1.0))
        return None

    async def _send(
        self, method: str, url: str, body: Any, stream: bool
    ) -> tuple[int, Any, httpx.Headers]:
        if not stream:
            r = await self.client.request(method, url, json=body)
            return r.status_code, _json(r), r.headers
        async with self.client.stream(method, url, json=body) as r:
            if r.status_code >= 400:
                await r.aread()
                return r.status_code, _json(r), r.headers
            last: dict[str, Any] = {}
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = orjson.loads(line[6:])
                    if event.get("usage"):
                        last = event
            return r.status_code, last, r.headers

    async def turn(self, sid: str, i: int, k: int, salt: str = "") -> TurnResult | None:
        stream = (i + k) % 2 == 1
        body: dict[str, Any] = {
            "model": self.model,
            "session_id": sid,
            "messages": [{"role": "user", "content": f"Turn {k}{salt} of session {i}: and?"}],
            "max_tokens": self.args.max_tokens,
            "temperature": 0,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        t0 = time.perf_counter()
        out = await self.call("POST", "/v1/chat/completions", body, stream=stream)
        if out is None:
            return None
        usage, session = out.get("usage") or {}, out.get("session") or {}
        if "context_tokens" not in session or "prompt_tokens" not in usage:
            self.fail(f"session {sid} turn {k}: no usage/session in the answer: {out}")
            return None
        return TurnResult(
            usage["prompt_tokens"],
            usage["completion_tokens"],
            session["context_tokens"],
            time.perf_counter() - t0,
            k,
        )

    async def session(self, i: int, bar: Any) -> tuple[str, int, list[TurnResult]] | None:
        rng = random.Random(i)
        text = " ".join(rng.choice(WORDS) for _ in range(self.args.context_words))
        create = {
            "model": self.model,
            "messages": [
                {"role": "system", "content": f"You are load test session {i}."},
                {"role": "user", "content": text},
            ],
            "ttl": LONG_TTL,
            "max_tokens": 0,
        }
        out = await self.call("POST", "/v1/context", create)
        bar.update(1)
        if out is None:
            return None
        sid, ctx0 = out["session_id"], out["session"]["context_tokens"]
        results: list[TurnResult] = []
        for k in range(1, self.args.turns + 1):
            race = k == 1 and self.args.race_every and i % self.args.race_every == 0
            if race:  # one client sends the same turn twice at once: one must wait (409)
                pair = await asyncio.gather(self.turn(sid, i, k), self.turn(sid, i, k, "b"))
                results += [r for r in pair if r is not None]
            else:
                r = await self.turn(sid, i, k)
                results += [r] if r is not None else []
            bar.update(1)
        return sid, ctx0, results

    async def check_history(self, sid: str, ctx0: int, results: list[TurnResult]) -> None:
        """The stored session is exactly what the client was answered: turns, tokens, chain."""
        info = await self.call("GET", f"/v1/context/{sid}")
        if info is None:
            return
        for problem in history_problems(ctx0, results, info["turns"], info["context_tokens"]):
            self.fail(f"session {sid}: {problem}")


def _json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text or None


def history_problems(
    ctx0: int, results: list[TurnResult], stored_turns: int, stored_tokens: int
) -> list[str]:
    """What is wrong with a stored session, given what the client was answered.

    Ordered by the context size each answer reported, every turn must have been prompted
    with the whole context before it (prompt > previous context: nothing lost, not built on
    a stale history) and have left exactly prompt + completion tokens; the stored session
    must hold the create plus one turn per answered turn (none lost, none duplicated) and
    the last answer's context size.
    """
    problems: list[str] = []
    before = ctx0
    for r in sorted(results, key=lambda r: r.context_tokens):
        if r.context_tokens != r.prompt_tokens + r.completion_tokens or r.prompt_tokens <= before:
            problems.append(
                f"turn {r.index} not built on the previous one (context before {before}, "
                f"prompt {r.prompt_tokens}, completion {r.completion_tokens}, "
                f"after {r.context_tokens})"
            )
        before = r.context_tokens
    if (stored_turns, stored_tokens) != (1 + len(results), before):
        problems.append(
            f"stored {stored_turns} turns / {stored_tokens} tokens, the client was answered "
            f"{1 + len(results)} / {before}"
        )
    return problems
