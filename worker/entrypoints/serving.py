"""What both completion endpoints share: checking a prompt, running it on the engine.

`Generation.start` validates and submits (raising the OpenAI errors before any byte is
sent); iterating it yields the engine's events on the event loop; `collect` waits for all
choices.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ctxcache.errors import ContextLengthExceeded, CtxError, InvalidRequest, NotFound
from ctxcache.lmcache_keys import SESSION_TAG, tags_from_params
from worker.engine.engine import Engine
from worker.engine.request import Event, Request, SamplingParams
from worker.engine.runner import ModelRunner
from worker.entrypoints.protocol import SamplingFields
from worker.kv.hashing import salt_root
from worker.settings import WorkerSettings


class ModelNotFound(NotFound):
    code = "model_not_found"
    default_message = "the model does not exist"


@dataclass
class WorkerState:
    """Everything the endpoints reach through `request.app.state.worker`."""

    settings: WorkerSettings
    runner: ModelRunner
    engine: Engine
    metrics: Any

    @property
    def model_name(self) -> str:
        return self.settings.served_name

    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")

    def check_ids(self, ids: list[int], param: str = "prompt") -> None:
        vocab = self.runner.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(
                f"token id {bad} is out of vocabulary (0..{vocab - 1})", param=param
            )


@dataclass
class Choice:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


@dataclass
class Generation:
    """One submitted request: its events arrive on an asyncio queue."""

    request: Request
    prompt_tokens: int
    queue: asyncio.Queue[Event]

    @classmethod
    def start(
        cls,
        state: WorkerState,
        ids: list[int],
        body: SamplingFields,
        default_max_tokens: int | None,
    ) -> Generation:
        state.check_model(body.model)
        if not ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        state.check_ids(ids)
        if body.n > state.settings.max_n:
            raise InvalidRequest(f"n must be at most {state.settings.max_n}", param="n")
        limit = state.runner.max_model_len
        max_tokens = body.max_tokens if body.max_tokens is not None else default_max_tokens
        ids = _fit(ids, max_tokens, limit, state.settings.sink_window)
        if max_tokens is None:
            max_tokens = limit - len(ids)
        try:
            tags = tags_from_params(body.kv_transfer_params)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="kv_transfer_params") from None
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k if body.top_k is not None else -1,
            seed=body.seed,
            n=body.n,
            stop=body.stop_list,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
        )
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        request = Request(
            request_id=uuid.uuid4().hex,
            prompt_ids=ids,
            params=params,
            emit=lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev),
            tags=tags,
            session=dict(tags).get(SESSION_TAG, "-"),
            cache_root=salt_root(body.cache_salt),
        )
        state.engine.submit(request)
        return cls(request, len(ids), queue)

    async def events(self) -> AsyncIterator[Event]:
        """The events of every choice, until all `n` have finished."""
        left = self.request.params.n
        try:
            while left:
                event = await self.queue.get()
                if event.finish_reason == "error":
                    raise CtxError("the engine failed on this request")
                if event.finish_reason is not None:
                    left -= 1
                yield event
        finally:
            if left:
                self.request.cancelled.set()

    async def collect(self) -> list[Choice]:
        choices = [Choice() for _ in range(self.request.params.n)]
        async for ev in self.events():
            c = choices[ev.index]
            c.token_ids += ev.token_ids
            c.text += ev.text
            c.finish_reason = ev.finish_reason or c.finish_reason
        return choices

    @property
    def cached_tokens(self) -> int:
        return self.request.cached_tokens


def _fit(
    ids: list[int], max_tokens: int | None, limit: int, sink_window: tuple[int, int] | None
) -> list[int]:
    """The prompt the model will see, or ContextLengthExceeded.

    With an attention-sink window (S, W) an over-long prompt keeps its first S and last W
    tokens — the model then sees a different context, so outputs change.
    """
    need = len(ids) + (max_tokens or 1)
    if need <= limit:
        return ids
    if sink_window is not None:
        sink, window = sink_window
        fitted = ids[:sink] + ids[-window:]
        if len(fitted) + (max_tokens or 1) <= limit:
            return fitted
    raise ContextLengthExceeded(
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{len(ids) + (max_tokens or 0)} tokens ({len(ids)} in the prompt, "
        f"{max_tokens or 0} in the completion). Please reduce the length of the prompt or "
        "the completion.",
        param="prompt",
    )
