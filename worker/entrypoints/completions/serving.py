"""`/v1/completions`: a text or token-id prompt, one response or a stream of chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse

from ctxcache.errors import InvalidRequest
from worker.entrypoints import sse
from worker.entrypoints.completions.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)
from worker.entrypoints.protocol import usage
from worker.entrypoints.serving import Generation, WorkerState


class CompletionServing:
    def __init__(self, state: WorkerState) -> None:
        self.state = state

    def prompt_ids(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequest(
                    "batched prompts are not supported; send one prompt", param="prompt"
                )
            prompt = prompt[0]  # type: ignore[assignment]
        if isinstance(prompt, str):
            return list(self.state.runner.tokenizer.encode(prompt, add_special_tokens=True))
        return list(prompt)  # type: ignore[arg-type]

    async def create(self, body: CompletionRequest) -> CompletionResponse | StreamingResponse:
        if body.echo or body.suffix:
            raise InvalidRequest("echo and suffix are not supported", param="echo")
        gen = Generation.start(self.state, self.prompt_ids(body), body, default_max_tokens=16)
        if body.stream:
            return sse.stream(self._chunks(body, gen))
        choices = await gen.collect()
        return CompletionResponse(
            model=self.state.model_name,
            choices=[
                CompletionChoice(
                    index=i,
                    text=c.text,
                    finish_reason=c.finish_reason,
                    token_ids=c.token_ids if body.return_token_ids else None,
                    prompt_token_ids=gen.request.prompt_ids if body.return_token_ids else None,
                )
                for i, c in enumerate(choices)
            ],
            usage=usage(
                gen.prompt_tokens, sum(len(c.token_ids) for c in choices), gen.cached_tokens
            ),
        )

    async def _chunks(self, body: CompletionRequest, gen: Generation) -> AsyncIterator[str]:
        head = CompletionResponse(model=self.state.model_name, choices=[])
        completion_tokens = 0
        first = [True] * body.n
        async for ev in gen.events():
            completion_tokens += len(ev.token_ids)
            choice = CompletionChoice(index=ev.index, text=ev.text, finish_reason=ev.finish_reason)
            if body.return_token_ids:
                choice.token_ids = ev.token_ids
                if first[ev.index]:
                    choice.prompt_token_ids = gen.request.prompt_ids
            first[ev.index] = False
            yield sse.event(head.model_copy(update={"choices": [choice]}))
        if body.include_usage:
            final = head.model_copy(
                update={"usage": usage(gen.prompt_tokens, completion_tokens, gen.cached_tokens)}
            )
            yield sse.event(final)
