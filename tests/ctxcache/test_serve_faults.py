"""`ctxcache serve` survives its parts: `kill -9` of the sidecar, then of the engine, then
of Redis, each while conversations are taking turns. Every component is restarted by the
supervisor; every turn a client was answered is in its session exactly once (read back
from Redis, which serve started for this test); nothing answers a 5xx other than a 503
with `retry-after`; and a session whose KV was stored before the sidecar died reuses it
from the sidecar's disk tier once the sidecar and then the engine came back (the new
engine has an empty prefix cache: what it reuses comes from the sidecar).

Clients act as the openai SDK does: a 503, a 409 (`session_busy`, `request_in_progress`)
or a stream that ends with an `error` event is retried with the same `Idempotency-Key`, so
a turn whose answer was lost with its connection is answered from its record, not run
twice. No timing is asserted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from cache_manager.redis_url import open_store_redis
from cache_manager.store import SessionStore
from ctxcache.net import free_port
from tests.ctxcache.test_serve import start_serve, stop_serve
from tests.utils import require_vllm

log = logging.getLogger(__name__)

CONVERSATIONS = 4  # half of them streamed
SYSTEM = "You answer from this document. " + " ".join(
    f"Clause {i} says the history of every turn stays on the server." for i in range(20)
)
RETRYABLE = {503, 409}


def components(data: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((data / "components.json").read_text())
    return doc["components"]


def until(check: Callable[[], bool], what: str, within_s: float = 120.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, f"not within {within_s} s: {what}"
        time.sleep(0.1)


@dataclass
class Chat:
    """One conversation in its own thread: turns one after another, each retried (same
    Idempotency-Key) until it is answered. `transcript` holds what was answered."""

    url: str
    index: int
    stream: bool
    session_id: str = ""
    transcript: list[tuple[str, str]] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)

    def create(self, http: httpx.Client) -> None:
        body = {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."}]}
        r = http.post("/v1/context", json={**body, "ttl": 3600})
        assert r.status_code == 200, r.text
        self.session_id = r.json()["session_id"]

    def run(self, stop: threading.Event) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as http:
            n = 0
            while not stop.is_set():
                n += 1
                question = f"conversation {self.index}, question {n}?"
                answer = self.turn(http, question, key=f"{self.session_id}-{n}")
                if answer is None:
                    return  # gave up: recorded in `errors`
                self.transcript.append((question, answer))

    def turn(self, http: httpx.Client, question: str, key: str) -> str | None:
        body: dict[str, Any] = {
            "model": "tiny",
            "session_id": self.session_id,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 6,
            "temperature": 0,
        }
        if self.stream:
            body.update(stream=True, stream_options={"include_usage": True})
        headers = {"Idempotency-Key": key}
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                status, answer, wait_s = self._attempt(http, body, headers)
            except httpx.TransportError as exc:  # a cut stream (after its error event)
                status, answer, wait_s = f"cut ({type(exc).__name__})", None, 0.5
            self.statuses[str(status)] += 1
            if answer is not None:
                return answer
            time.sleep(wait_s)
        self.errors.append(f"{key}: not answered within 180 s ({dict(self.statuses)})")
        return None

    def _attempt(
        self, http: httpx.Client, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[int | str, str | None, float]:
        """(status, the answer if it was answered, seconds to wait before a retry)."""
        with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                r.read()
                if r.status_code not in RETRYABLE:
                    self.errors.append(f"{r.status_code}: {r.text[:300]}")
                elif r.status_code == 503 and "retry-after" not in r.headers:
                    self.errors.append(f"503 without retry-after: {r.text[:300]}")
                wait_ms = int(r.headers.get("retry-after-ms", "500"))
                return r.status_code, None, min(wait_ms, 5000) / 1000
            if not self.stream:
                r.read()
                return 200, r.json()["choices"][0]["message"]["content"], 0
            text, done = "", False
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:  # the stream broke off: what the SDK raises
                    return f"stream error {event['error'].get('code')}", None, 0.5
                for choice in event.get("choices", ()):
                    text += choice["delta"].get("content") or ""
            return (200, text, 0) if done else ("stream cut", None, 0.5)


async def stored_turns(redis_url: str, session_id: str) -> list[tuple[str, str]]:
    """The session's (question, answer) pairs as Redis holds them."""
    async with open_store_redis(redis_url, timeout_s=5) as redis:
        state = await SessionStore(redis).begin(
            session_id,
            "default",
            lock=None,
            lock_ttl_ms=1000,
            tokens=False,
            messages=True,
            touch=False,
        )
    assert isinstance(state, tuple)
    messages = [m for m in state[2] if m["role"] != "system"]
    pairs = list(zip(messages[::2], messages[1::2], strict=True))
    assert all(q["role"] == "user" and a["role"] == "assistant" for q, a in pairs)
    return [(q["content"], a["content"]) for q, a in pairs]


def redis_url_of(pid: int) -> str:
    """The bundled Redis's URL: its process title reads `redis-server 127.0.0.1:PORT`."""
    title = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
    found = re.search(r"127\.0\.0\.1:(\d+)", title)
    assert found, title
    return f"redis://127.0.0.1:{found[1]}/0"


def cached(http: httpx.Client, session_id: str, question: str) -> int:
    """A read-only turn (nothing appended): its cached prompt tokens."""
    body = {
        "model": "tiny",
        "session_id": session_id,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 2,
        "temperature": 0,
        "session_append": False,
    }
    for _ in range(120):  # (the engine may not be back in the gateway's pool yet)
        r = http.post("/v1/chat/completions", json=body)
        if r.status_code == 200:
            return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert r.status_code == 503, r.text
        time.sleep(1)
    raise AssertionError("no answer")


@pytest.mark.timeout(1800)
@pytest.mark.parametrize(
    "engine",
    [pytest.param(e, marks=pytest.mark.slow) for e in ("builtin", "vllm")],  # docs/testing.md
    ids=str,
)
def test_killed_sidecar_engine_and_redis_are_restarted_and_no_turn_is_lost(
    tmp_path: Path, tiny_model: Path, engine: str
) -> None:
    if engine == "vllm":
        require_vllm()
    engine_name = {"builtin": "worker", "vllm": "vllm"}[engine]
    data, port = tmp_path / "data", free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_serve(data, port, tmp_path / "serve.log", engine, "--model", str(tiny_model))
    stop = threading.Event()
    try:
        with httpx.Client(base_url=url, timeout=120) as http:
            # a session whose KV goes to the sidecar, and from there (written behind) to disk
            r = http.post(
                "/v1/context",
                json={
                    "model": "tiny",
                    "messages": [{"role": "system", "content": SYSTEM}],
                    "ttl": 3600,
                },
            )
            assert r.status_code == 200, r.text
            kept, kept_tokens = r.json()["session_id"], r.json()["usage"]["prompt_tokens"]
            control = json.loads((data / "ports.json").read_text())["sidecar_control"]
            sidecar = f"http://127.0.0.1:{control}"
            until(
                lambda: httpx.get(f"{sidecar}/stats").json()["disk_blocks"] > 0,
                "the session's KV written behind to the disk tier",
            )

            chats = [Chat(url, i, stream=i % 2 == 1) for i in range(CONVERSATIONS)]
            for chat in chats:
                chat.create(http)
            threads = [threading.Thread(target=c.run, args=(stop,)) for c in chats]
            for t in threads:
                t.start()

            def turns() -> int:
                return sum(len(c.transcript) for c in chats)

            until(lambda: turns() >= 2 * CONVERSATIONS, "turns before any fault")
            for component in ("sidecar", engine_name, "redis"):
                pid = components(data)[component]["pid"]
                log.info("kill -9 %s (pid %d)", component, pid)
                os.kill(pid, signal.SIGKILL)
                if engine == "vllm" and component == engine_name:
                    # vLLM takes about a minute to start: /ready says so meanwhile
                    until(lambda: "vllm is starting" in ready(http), "/ready names vllm", 60)
                until(
                    lambda c=component: (
                        components(data)[c]["restarts"] == 1
                        and components(data)[c]["state"] == "up"
                    ),
                    f"{component} restarted",
                    600,
                )
                after = turns()  # and turns go on after the restart
                until(lambda a=after: turns() >= a + CONVERSATIONS, f"turns after {component}")
                if component == engine_name:
                    # a new engine (an empty prefix cache): the KV comes from the sidecar,
                    # which was restarted since it was stored
                    assert cached(http, kept, "Anything new?") >= kept_tokens // 2
            stop.set()
            for t in threads:
                t.join(timeout=300)

            status = components(data)
            log.info(
                "start times after the restarts: %s", {n: c["start_s"] for n, c in status.items()}
            )
            assert {n: (c["state"], c["restarts"]) for n, c in status.items()} == {
                n: ("up", 1) for n in ("redis", "sidecar", engine_name)
            } | {"gateway": ("up", 0)}
            redis_url = redis_url_of(status["redis"]["pid"])
            for chat in chats:
                assert not chat.errors, chat.errors
                stored = asyncio.run(stored_turns(redis_url, chat.session_id))
                assert stored == chat.transcript  # every answered turn, once, in order
            seen = sum((c.statuses for c in chats), Counter())
            log.info("answers seen by the clients: %s", dict(seen))
            assert not [s for s in seen if s.isdigit() and int(s) >= 500 and s != "503"]
    finally:
        stop.set()
        stop_serve(proc)


def ready(http: httpx.Client) -> str:
    """/ready's answer: 'ready', or the message of its 503."""
    r = http.get("/ready")
    if r.status_code == 200:
        return "ready"
    assert r.status_code == 503 and "retry-after" in r.headers, r.text
    return str(r.json()["error"]["message"])
