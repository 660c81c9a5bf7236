"""Relaying a session turn's stream: the worker's events, shaped for the client, with
the turn committed before the final usage chunk (`TurnService.stream`)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

import orjson

from ctxcache.errors import BackendUnavailable, CtxError
from gateway import metering
from gateway.metrics import GatewayMetrics
from gateway.pool import WorkerPool
from gateway.shaping import Shaper, normalize_usage
from gateway.tools import StreamedCalls
from gateway.turn_engine import check_prompt
from gateway.turn_types import Generation, Release, Turn
from gateway.upstream import SSEStream, WorkerDown

log = logging.getLogger(__name__)


async def relay(
    turn: Turn,
    upstream: SSEStream,
    shaper: Shaper,
    include_usage: bool,
    on_done: Callable[[Generation], Awaitable[dict[str, Any]]],
    *,
    pool: WorkerPool,
    metrics: GatewayMetrics,
    release_now: Release,
) -> AsyncGenerator[bytes, None]:
    """Stream the worker's tokens to the client; commit before the final usage chunk.

    If the client goes away (or anything fails) before the commit, the turn is
    dropped: the lock is released and nothing is appended.
    """
    assert turn.worker is not None
    call = turn.engine_call or metering.EngineCall()
    committed = False
    fail = getattr(shaper, "failed", None)  # a shaper that can end a stream with an error
    try:
        if head := shaper.start():
            yield head
        async with pool.lease(turn.worker):
            text: list[str] = []
            ids: list[int] = []
            finish: str | None = None
            usage: dict[str, Any] | None = None
            first = True
            calls = StreamedCalls()
            role: dict[str, Any] = {}  # a chat delta's other fields (reasoning, ...)
            logprobs: list[Any] = []
            async for data in upstream.events():
                if data == b"[DONE]":  # the body ends right after it: reading it to its
                    continue  # end keeps the worker's connection for the next call
                event = orjson.loads(data)
                if event.get("usage") and not event.get("choices"):
                    usage = event["usage"]
                    call.done(normalize_usage(usage))  # (paid even if the commit fails)
                    continue
                for choice in event.get("choices") or []:
                    if first:
                        seconds = time.perf_counter() - turn.started
                        metrics.first_token("session", seconds, streamed=True)
                        first = False
                    if turn.chat_engine:
                        delta = choice.get("delta") or {}
                        text.append(delta.get("content") or "")
                        calls.add(delta.get("tool_calls"))
                        role.update(delta)
                        if choice.get("logprobs"):
                            logprobs.append(choice["logprobs"])
                    else:
                        text.append(choice.get("text") or "")
                    ids.extend(choice.get("token_ids") or [])
                    call.relayed(len(choice.get("token_ids") or ()))
                    finish = choice.get("finish_reason") or finish
                    yield shaper.content(choice)
            gen = Generation("".join(text), ids, finish, normalize_usage(usage))
            if turn.chat_engine:
                tool_calls = calls.list()
                content = gen.text if gen.text or not tool_calls else None
                gen.message = {**role, "content": content, "tool_calls": tool_calls}
                gen.logprobs = logprobs or None
                metrics.tool_calls.inc(len(tool_calls))
            check_prompt(turn, gen.usage)
            metrics.tokens(gen.usage)
            session = await on_done(gen)
            committed = True
            if include_usage:
                yield shaper.usage(gen.usage, session)
            yield shaper.end
    except Exception as exc:
        if fail is None:
            raise  # the client's connection is cut: that is how its format ends badly
        error = exc
        if isinstance(exc, WorkerDown):
            pool.mark_down(exc.worker, str(exc))
            error = BackendUnavailable(f"the worker stopped mid-answer ({exc})")
        elif not isinstance(exc, CtxError):
            log.exception("a streamed turn failed")
        await release_now(turn.tenant, turn.state)
        committed = True  # (released: nothing left to do below)
        yield fail(error)
    finally:
        if not committed:
            await release_now(turn.tenant, turn.state)
        await upstream.aclose()
