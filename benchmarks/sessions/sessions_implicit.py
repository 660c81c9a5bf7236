"""Implicit conversations in `ctxcache bench sessions --implicit` (docs/implicit.md): clients
that never send `session_id` and resend the whole conversation on every request.

- The idle mass gets as many implicit conversations as there are sessions at each size,
  in bulk through the manager's own create (`SessionService.create` with origin
  "implicit" and the `ImplicitMark` a gateway writes for a first answer): a 2-message
  context and the fake engine's answer, its state named by the digest the gateway computes
  for those messages (`gateway.implicit.digests`, the same match key), so a request that
  extends one is found, loaded and served as its turn.
- The mixed load adds, beside the explicit operations, implicit turns of an active set of
  implicit conversations (`implicit`: the whole conversation so far, the gateway's answers
  appended as a client appends them, and a new user message; no `session_id`) and first
  requests of new conversations (`implicit_new`: a miss, one new implicit session).
- Before each size's mixed load a few bulk conversations are woken (one turn each): the
  proof that the gateway finds what the bulk wrote. `ctxcache_gateway_implicit_total` is
  read from the gateway's /metrics around both, so hits are counted by the gateway itself.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from benchmarks.sessions.sessions_stack import (
    BULK_TTL,
    CHUNK,
    MODEL,
    TENANT,
    Stack,
    bulk_create,
    context_messages,
    fake_ids,
)

if TYPE_CHECKING:
    from cache_manager.protocol import CreateSession, SessionInfo

# operation -> weight in the mixed load, beside the explicit ones (the same shares as the
# explicit turn and create: the columns compare like with like)
IMPLICIT_MIX = {"implicit": 60, "implicit_new": 15}
ANSWER = " ok"  # what the fake engine answers a 3-token request
RESULTS = ("hit", "branch", "miss", "passed", "unkept")
WAKE = 20  # bulk conversations woken at each size (at most)

Message = dict[str, Any]
Call = Callable[[Any, str, str, str, Any], Awaitable[Any]]


def match_seed() -> bytes:
    """The seed of the bench's conversations' digests: as the gateway seeds a request of
    the tenant's with no tools, no `prompt_cache_key`, no `cache_salt`."""
    from gateway.implicit.digests import seed

    return seed(TENANT, MODEL, None, None, None)


@dataclass
class Conversation:
    messages: list[Message]  # as the client resends them: its requests' and the answers
    tokens: int  # of the conversation after its latest answer (the answer's usage)


@dataclass
class Conversations:
    """The bench's implicit clients: the active set, and what the bulk wrote."""

    words: int
    rng: random.Random = field(default_factory=lambda: random.Random(55))
    free: list[Conversation] = field(default_factory=list)  # active, no request in flight
    idle: list[tuple[str, str]] = field(default_factory=list)  # bulk: session id, digest
    sleepers: list[Conversation] = field(default_factory=list)  # bulk ones to wake

    def bulk_create(self) -> Callable[[random.Random], CreateSession]:
        """A bulk implicit conversation: the session a gateway keeps after answering a new
        conversation's first request (its messages and the answer, the prompt's ids and
        the answer's, the state's digest)."""
        from cache_manager.protocol import CreateSession, ImplicitMark
        from gateway.implicit.digests import chain

        start = match_seed()

        def make(rng: random.Random) -> CreateSession:
            sent = context_messages(rng, self.words)
            messages = [*sent, {"role": "assistant", "content": ANSWER}]
            digest = chain(start, messages)[-1]
            assert digest is not None
            return CreateSession(
                tenant=TENANT,
                model=MODEL,
                kind="chat",
                tokens=fake_ids(sent) + list(b"<assistant>") + list(ANSWER.encode()),
                messages=messages,
                ttl=BULK_TTL,
                origin="implicit",
                implicit=ImplicitMark(digest=digest, messages=len(messages), ttl=BULK_TTL),
            )

        return make

    def bulk_made(self, req: CreateSession, info: SessionInfo) -> None:
        assert req.implicit is not None
        if len(self.sleepers) < WAKE:  # (woken, they are idle no more: not in `idle`)
            self.sleepers.append(Conversation(list(req.messages), len(req.tokens)))
        else:
            self.idle.append((info.session_id, req.implicit.digest))

    @staticmethod
    def body(messages: list[Message]) -> dict[str, Any]:
        return {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0}

    async def start(self, call: Call, w: Any, *, keep: bool) -> None:
        """A new conversation's first request (a miss); `keep`: it joins the active set."""
        messages = context_messages(self.rng, self.words)
        out = await call(w, "implicit_new", "POST", "/v1/chat/completions", self.body(messages))
        if out is not None and keep:
            answer = out["choices"][0]["message"]
            self.free.append(Conversation([*messages, answer], out["usage"]["total_tokens"]))

    async def turn(self, call: Call, w: Any, conv: Conversation | None = None) -> None:
        """The next request of an active conversation (or of `conv`): all of it resent and
        a new user message."""
        if conv is None:
            if not self.free:
                return
            conv = self.free.pop(self.rng.randrange(len(self.free)))
            back = True
        else:
            back = False
        ask = {"role": "user", "content": f"And what about {self.rng.random()}?"}
        sent = [*conv.messages, ask]
        try:
            out = await call(w, "implicit", "POST", "/v1/chat/completions", self.body(sent))
        finally:
            if back:
                self.free.append(conv)
        if out is None:
            return
        # what the sidecar could hold: the full chunks of the conversation before the turn
        could = conv.tokens // CHUNK * CHUNK
        w.implicit_cached += min(out["usage"]["prompt_tokens_details"]["cached_tokens"], could)
        w.implicit_chunk += could
        conv.messages = [*sent, out["choices"][0]["message"]]
        conv.tokens = out["usage"]["total_tokens"]

    async def wake(self, call: Call, w: Any) -> int:
        """One turn of each of the latest bulk's first conversations; returns how many."""
        sleepers, self.sleepers = self.sleepers, []
        for conv in sleepers:
            await self.turn(call, w, conv)
        return len(sleepers)


def results(text: str) -> dict[str, float]:
    """`ctxcache_gateway_implicit_total` by result, from the gateway's /metrics."""
    name = "ctxcache_gateway_implicit_total{"
    out = dict.fromkeys(RESULTS, 0.0)
    for line in text.splitlines():
        if line.startswith(name):
            labels, value = line[len(name) :].rsplit(" ", 1)
            result = labels.split('result="', 1)[1].split('"', 1)[0]
            out[result] = out.get(result, 0.0) + float(value)
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {k: int(after.get(k, 0.0) - before.get(k, 0.0)) for k in after}


async def fill_implicit(
    args: argparse.Namespace, stack: Stack, redis: Any, conv: Conversations, n: int
) -> dict[str, Any]:
    """The idle implicit conversations, up to the size (`n` more); what they cost Redis."""
    from tqdm import tqdm

    n = max(0, n)
    used = (await redis.info("memory"))["used_memory"]
    with tqdm(total=n, desc="implicit bulk", unit="conv", disable=args.no_progress) as bar:
        bulk_s = await bulk_create(args, stack, n, bar, conv.bulk_create(), conv.bulk_made)
    grown = (await redis.info("memory"))["used_memory"] - used
    return {
        "implicit_bulk_created": n,
        "implicit_bulk_per_s": round(n / bulk_s, 1) if n else None,
        # INFO used_memory's growth over the bulk, a conversation
        "redis_bytes_per_implicit": round(grown / n) if n else None,
    }


async def implicit_after(
    redis: Any, conv: Conversations, w: Any, size: int, got: dict[str, int], live: float
) -> dict[str, Any]:
    """The implicit columns of a size, after its mixed load: `got` is what the gateway
    counted (`ctxcache_gateway_implicit_total`) during it."""
    sample = random.Random(size).sample(conv.idle, min(200, len(conv.idle)))
    sampled = await implicit_bytes(redis, sample)
    implicit_live = await live_implicit(redis)
    turns = len(w.latencies["implicit"])
    return {
        "live_implicit": implicit_live,
        "redis_implicit_keys_bytes": round(sampled["keys"]),
        "redis_implicit_point_bytes": round(sampled["point"]),
        "redis_implicit_index_bytes": round(sampled["index"] / max(1, implicit_live), 1),
        "implicit_results": got,
        "implicit_hit_ratio": round(got["hit"] / turns, 4) if turns else None,
        "implicit_kv_hit_rate": (
            round(w.implicit_cached / w.implicit_chunk, 4) if w.implicit_chunk else None
        ),
    }


async def implicit_bytes(redis: Any, sample: list[tuple[str, str]]) -> dict[str, float]:
    """`MEMORY USAGE` of sampled bulk conversations: their session keys, their state's
    point; and the implicit index (its zset), whole."""
    from cache_manager.implicit import lru_key, point_key
    from cache_manager.keys import session_keys

    keys = points = 0
    for sid, digest in sample:
        for k in session_keys(sid)[:3]:
            keys += int(await redis.memory_usage(k, samples=0) or 0)
        points += int(await redis.memory_usage(point_key(TENANT, digest), samples=0) or 0)
    n = max(1, len(sample))
    return {
        "keys": keys / n,
        "point": points / n,
        "index": float(await redis.memory_usage(lru_key(TENANT), samples=5) or 0),
    }


async def live_implicit(redis: Any) -> int:
    import time

    from cache_manager.implicit import lru_key

    return int(await redis.zcount(lru_key(TENANT), f"({int(time.time() * 1000)}", "+inf"))
