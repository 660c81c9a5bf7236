"""Running a planned turn on a worker's engine: the engine request, failover to another
worker when one cannot be reached, and the metering and tracing around the call, for an
answer in one piece (`generate`) or a stream (`open_stream`, whose events `StreamedAnswer`
reads as `TurnService` relays them). What the call learns comes back with its result (the
`Generation` names the worker that ran it), never written into the `Turn`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import orjson

from ctxcache import tracing
from ctxcache.errors import BackendUnavailable
from gateway import metering
from gateway.metrics import GatewayMetrics
from gateway.pool import Worker, WorkerPool
from gateway.salt import CacheSalt
from gateway.shaping import normalize_usage
from gateway.tools import StreamedCalls, assistant_message, engine_tool_choice
from gateway.turn_planning import Turn, span_attributes
from gateway.upstream import SSEStream, failover, open_stream, post_json

log = logging.getLogger(__name__)


# A chat request's messages when its prompt is given as token ids: vLLM does not render them
# (it feeds `kv_transfer_params.prompt_token_ids` to the engine); a message says so in its log.
PLACEHOLDER = [{"role": "user", "content": "(ctxcache: the prompt is prompt_token_ids)"}]


@dataclass
class Generation:
    """What the engine answered a turn, and the worker that ran it."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: dict[str, Any]
    # from the engine's chat endpoint (a turn with tools, a format, logprobs; every chat turn
    # of a deployment with a reasoning parser): the answer's message as the engine parsed it
    # (content, tool_calls, reasoning: the whole thinking or None, ...) and its logprobs
    message: dict[str, Any] | None = None
    logprobs: Any = None
    worker: Worker | None = None  # (after a failover: not the one the turn was planned on)

    def assistant(self) -> dict[str, Any]:
        """The assistant message the history keeps."""
        if self.message is None:
            return {"role": "assistant", "content": self.text}
        return assistant_message(self.message)


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
    """Runs `TurnService`'s turns on the pool's workers."""

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
            # (the prompt renders all of the turn's tools; an `allowed_tools` choice is
            # its mode, with only the allowed tools for the engine to hold calls to)
            choice, tools = engine_tool_choice(body.get("tool_choice"), turn.tools)
            if choice is not None:
                body["tool_choice"] = choice
            if tools:
                body["tools"] = tools
            transfer["prompt_token_ids"] = turn.prompt
        else:
            body["prompt"] = turn.prompt
            for name in turn.variant.drops:
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
            out, worker = await failover(
                self.pool, turn.model, lambda w: post_json(w, path, body), first=turn.worker
            )
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
            worker=worker,
        )

    async def open_stream(self, turn: Turn) -> tuple[SSEStream, metering.EngineCall]:
        """Start the worker's stream before answering: an error the worker answers (a bad
        sampling field, say) still reaches the client as an error, not a broken 200. With
        the stream, its call's meter (it counts the tokens relayed, until its usage)."""
        body = orjson.dumps(self._worker_body(turn, stream=True))
        call = metering.call(len(turn.prompt))
        with (
            tracing.span("ctxcache.generate", span_attributes(turn), client=True),
            call,
        ):
            path = engine_path(turn)
            upstream, _ = await failover(
                self.pool, turn.model, lambda w: open_stream(w, path, body), first=turn.worker
            )
        call.streaming()  # from here on: its prompt + the tokens relayed, until its usage
        return upstream, call


class StreamedAnswer:
    """A turn's answer read from its stream's choices, as they are relayed: the text and
    token ids, and from the engine's chat endpoint the deltas' other fields (tool calls,
    reasoning, logprobs), put together into the `Generation` the turn commits."""

    def __init__(self, turn: Turn, call: metering.EngineCall) -> None:
        self.chat = turn.chat_engine
        self.call = call
        self.text: list[str] = []
        self.ids: list[int] = []
        self.finish: str | None = None
        self.calls = StreamedCalls()
        self.role: dict[str, Any] = {}  # a chat delta's other fields (role, ...)
        self.reasoning: list[str] = []  # the pieces of the thinking (vLLM's `reasoning`)
        self.logprobs: list[Any] = []

    def add(self, choice: dict[str, Any]) -> None:
        if self.chat:
            delta = choice.get("delta") or {}
            self.text.append(delta.get("content") or "")
            self.calls.add(delta.get("tool_calls"))
            for key, value in delta.items():
                if key == "reasoning":
                    if value:
                        self.reasoning.append(value)
                elif key not in ("content", "tool_calls"):
                    self.role[key] = value
            if choice.get("logprobs"):
                self.logprobs.append(choice["logprobs"])
        else:
            self.text.append(choice.get("text") or "")
        ids = choice.get("token_ids") or ()
        self.ids.extend(ids)
        self.call.relayed(len(ids))
        self.finish = choice.get("finish_reason") or self.finish

    def generation(
        self, usage: dict[str, Any] | None, worker: Worker, metrics: GatewayMetrics
    ) -> Generation:
        text = "".join(self.text)
        message, logprobs = None, None
        if self.chat:
            tool_calls = self.calls.list()
            content = text if text or not tool_calls else None
            message = {**self.role, "content": content, "tool_calls": tool_calls}
            if self.reasoning:
                message["reasoning"] = "".join(self.reasoning)
            logprobs = self.logprobs or None
            metrics.tool_calls.inc(len(tool_calls))
        usage = normalize_usage(usage)
        return Generation(text, self.ids, self.finish, usage, message, logprobs, worker)
