"""Running a planned turn on a worker's engine: the engine request, failover to another
worker when one cannot be reached, and the metering and tracing around the call, for an
answer in one piece (`generate`) or a stream (`open_stream`; `gateway.turn_stream` relays it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from ctxcache import tracing
from ctxcache.errors import BackendUnavailable
from gateway import metering
from gateway.metrics import GatewayMetrics
from gateway.pool import Worker, WorkerPool
from gateway.salt import CacheSalt
from gateway.shaping import normalize_usage
from gateway.tools import AGENT_FIELDS
from gateway.turn_types import Generation, Turn, span_attributes
from gateway.upstream import SSEStream, WorkerDown, open_stream, post_json

log = logging.getLogger(__name__)


# A chat request's messages when its prompt is given as token ids: vLLM does not render them
# (it feeds `kv_transfer_params.prompt_token_ids` to the engine); a message says so in its log.
PLACEHOLDER = [{"role": "user", "content": "(ctxcache: the prompt is prompt_token_ids)"}]


def engine_path(turn: Turn) -> str:
    return "/v1/chat/completions" if turn.chat_engine else "/v1/completions"


def check_prompt(turn: Turn, usage: dict[str, Any]) -> None:
    """The engine ran the turn's own prompt. On the chat endpoint an engine that does not
    take the prompt as token ids would render the placeholder instead: such an answer is
    never appended."""
    if turn.chat_engine and usage.get("prompt_tokens") != len(turn.prompt):
        log.error(
            "the engine answered a %d-token prompt for a %d-token turn: it does not take "
            "kv_transfer_params.prompt_token_ids (vLLM >= 0.32 does)",
            usage.get("prompt_tokens"),
            len(turn.prompt),
        )
        raise BackendUnavailable("the engine did not run the session's prompt")


class TurnEngine:
    """Runs `TurnService`'s turns (and any call that should fail over) on the pool's workers."""

    def __init__(self, pool: WorkerPool, metrics: GatewayMetrics, salt: CacheSalt) -> None:
        self.pool = pool
        self.metrics = metrics
        self.salt = salt

    def _worker_body(self, turn: Turn, *, stream: bool) -> dict[str, Any]:
        """The engine request. A turn on the chat endpoint gives its prompt as token ids in
        `kv_transfer_params.prompt_token_ids` (vLLM feeds them to the engine as they are,
        rendering no messages) and its tools and format, which drive vLLM's tool parser
        and structured outputs (docs/agents.md); `messages` is then only a placeholder."""
        body: dict[str, Any] = {
            **turn.sampling,
            "model": turn.model,
            "return_token_ids": True,
            "stream": stream,
        }
        transfer: dict[str, Any] = {}
        if turn.chat_engine:
            body["messages"] = PLACEHOLDER
            body.pop("return_tokens_as_token_ids", None)
            if turn.tools:
                body["tools"] = turn.tools
            transfer["prompt_token_ids"] = turn.prompt
        else:
            body["prompt"] = turn.prompt
            if turn.kind == "chat":  # (only empty ones are left: `tools: []`, and such)
                for name in AGENT_FIELDS:
                    body.pop(name, None)
        if stream:
            body["stream_options"] = {"include_usage": True}
        if turn.kv_tag is not None:
            transfer["lmcache.tag.s"] = turn.kv_tag
        if transfer:
            body["kv_transfer_params"] = transfer
        if turn.priority:
            body["priority"] = turn.priority
        self.salt.apply(turn.tenant, body)
        return body

    async def failover(
        self,
        model: str,
        call: Callable[[Worker], Awaitable[Any]],
        *,
        affinity: str | None = None,
        first: Worker | None = None,
    ) -> tuple[Any, Worker]:
        """Run `call` on a worker; if that worker is down, on the next healthy one.

        Only a worker that could not be reached counts as down: nothing ran there, so
        running the call elsewhere is safe (the KV is recomputed there). When no healthy
        worker is left, `pick` raises `backend_unavailable`.
        """
        tried: list[str] = []
        worker = first or self.pool.pick(model, affinity=affinity)
        while True:
            try:
                async with self.pool.lease(worker):
                    return await call(worker), worker
            except WorkerDown as exc:
                self.pool.mark_down(worker, str(exc))
                tried.append(worker.id)
                worker = self.pool.pick(model, exclude=tried)
                log.info("retrying on worker %s (KV is recomputed there)", worker.id)

    async def _with_failover(self, turn: Turn, call: Callable[[Worker], Awaitable[Any]]) -> Any:
        result, turn.worker = await self.failover(turn.model, call, first=turn.worker)
        return result

    async def generate(self, turn: Turn) -> Generation:
        fields = self._worker_body(turn, stream=False)
        prefill_only = fields.get("max_tokens") == 0
        if prefill_only:
            # vLLM wants max_tokens >= 1: prefill, generate one token, and drop it (the
            # built-in worker honours 0, and gives the same answer this way).
            fields["max_tokens"] = 1
        body = orjson.dumps(fields)
        call = metering.call(len(turn.prompt))
        path = engine_path(turn)
        with (
            tracing.span("ctxcache.generate", span_attributes(turn), client=True),
            call,
        ):
            out = await self._with_failover(turn, lambda w: post_json(w, path, body))
        if not prefill_only:  # (a context only prefilled has no first token to wait for)
            # from the turn's start: loading the session and tokenizing count, as a client
            # waiting for its first token sees them (here with the whole answer: not streamed)
            seconds = time.perf_counter() - turn.started
            self.metrics.first_token("session", seconds, streamed=False)
        choice = (out.get("choices") or [{}])[0]
        usage = normalize_usage(out.get("usage"))
        if prefill_only:
            usage = {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}
            choice = {"text": "", "token_ids": [], "finish_reason": "length"}
        call.done(usage)  # charged whatever happens next (a commit that fails, say)
        self.metrics.tokens(usage)
        check_prompt(turn, usage)
        message = choice.get("message") if turn.chat_engine else None
        if message is not None:
            self.metrics.tool_calls.inc(len(message.get("tool_calls") or ()))
        text = message.get("content") if message is not None else choice.get("text")
        return Generation(
            text=text or "",
            token_ids=list(choice.get("token_ids") or []),
            finish_reason=choice.get("finish_reason"),
            usage=usage,
            message=message,
            logprobs=choice.get("logprobs"),
        )

    async def open_stream(self, turn: Turn) -> SSEStream:
        """Start the worker's stream before answering: an error the worker answers (a bad
        sampling field, say) still reaches the client as an error, not a broken 200."""
        body = orjson.dumps(self._worker_body(turn, stream=True))
        call = metering.call(len(turn.prompt))
        with (
            tracing.span("ctxcache.generate", span_attributes(turn), client=True),
            call,
        ):
            path = engine_path(turn)
            upstream: SSEStream = await self._with_failover(
                turn, lambda w: open_stream(w, path, body)
            )
        call.streaming()  # from here on: its prompt + the tokens relayed, until its usage
        turn.engine_call = call
        return upstream
