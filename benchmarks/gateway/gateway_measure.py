"""A case of `ctxcache bench gateway` (`Case`) and its measurement at one concurrency: with
`wrk` (`measure_wrk`), or with our own generator (`measure_ours`), which also runs session
turns (a conversation per connection) and measures the streams' TTFT. See
benchmarks/gateway/gateway.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from benchmarks.gateway.gateway_report import Sample
from benchmarks.gateway.gateway_stack import KEY

AUTH = {"Authorization": f"Bearer {KEY}"}
TURNS_PER_SESSION = 20


@dataclass
class Case:
    name: str
    model: str
    path: str
    body: dict[str, Any]
    concurrency: list[int]
    requests: int
    direct: bool = False
    session: str | None = None  # a session turn: "completion" or "chat"
    ttft: bool = False  # measured by our generator, for the time to the first chunk
    traced: bool = False  # through the gateway with tracing on (--tracing)
    bare: bool = False  # through the bare ASGI relay (--floor)

    @property
    def wrk_able(self) -> bool:
        return self.session is None and not self.ttft


async def measure_wrk(wrk_path: str, port: int, case: Case, conc: int, seconds: float) -> Sample:
    import orjson

    from benchmarks.gateway import wrk

    headers = {} if case.direct else AUTH
    url = f"http://127.0.0.1:{port}{case.path}"
    r = await wrk.run(
        wrk_path, url, orjson.dumps(case.body), headers, connections=conc, seconds=seconds
    )
    return Sample(r.requests_per_s, r.p50_ms, r.p99_ms, None, r.errors, "wrk")


async def measure_ours(port: int, gw_port: int, case: Case, conc: int) -> Sample:
    import httpx

    from benchmarks.gateway.loadgen import Conn, run
    from benchmarks.lib.util import percentile

    async def new_session() -> str:
        context = "A context of some length. " * 20
        start: dict[str, Any] = (
            {"messages": [{"role": "system", "content": context}]}
            if case.session == "chat"
            else {"prompt": context}
        )
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw_port}", headers=AUTH) as c:
            r = await c.post("/v1/context", json={"model": case.model, **start})
            r.raise_for_status()
            return str(r.json()["session_id"])

    # Each connection runs its own conversations, a fresh session every TURNS_PER_SESSION
    # turns (a chat is tens of turns, not thousands).
    slots: dict[int, list[int]] = {}  # conn -> [slot, turns so far]
    sids: list[str] = []
    if case.session is not None:
        need = conc * (case.requests // (conc * TURNS_PER_SESSION) + 2)
        sids = await asyncio.gather(*(new_session() for _ in range(need)))
        # each create pins its session's KV after answering: let that setup work finish
        # before the timed turns start
        await asyncio.sleep(1.0)

    def make(conn: Conn, i: int) -> bytes:
        if case.session is None:
            return conn.build("POST", case.path, case.body, None if case.direct else AUTH)
        slot = slots.setdefault(id(conn), [len(slots), 0])
        sid = sids[slot[0] + conc * (slot[1] // TURNS_PER_SESSION)]
        slot[1] += 1
        return conn.build("POST", *_session_turn(case.session, case.body, sid), AUTH)

    r = await run("127.0.0.1", port, make, requests=case.requests, concurrency=conc)
    lat = sorted(r.latencies)
    ttft = percentile(sorted(r.ttfts), 50) * 1e3 if case.ttft else None
    return Sample(
        len(lat) / r.seconds,
        percentile(lat, 50) * 1e3,
        percentile(lat, 99) * 1e3,
        ttft,
        r.errors,
        "ours",
    )


def streamed_chat(model: str, tokens: int) -> dict[str, Any]:
    """The streaming cases' request: a short chat question, `tokens` tokens (= chunks)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Say something about caches."}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }


def _session_turn(kind: str, body: dict[str, Any], sid: str) -> tuple[str, dict[str, Any]]:
    """(path, body) of a session turn: a new prompt, or a new user message."""
    if kind == "chat":
        turn = {k: v for k, v in body.items() if k != "prompt"}
        turn["messages"] = [{"role": "user", "content": "And?"}]
        return "/v1/chat/completions", {**turn, "session_id": sid}
    return "/v1/completions", {**body, "prompt": " and?", "session_id": sid}
