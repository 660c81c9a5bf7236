"""`/v1/chat/completions`: render the messages with the chat template, then complete."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse

from ctxcache.errors import InvalidRequest
from worker.entrypoints import sse
from worker.entrypoints.chat_completions.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatTemplateFields,
    DeltaMessage,
    ToolFields,
)
from worker.entrypoints.protocol import usage
from worker.entrypoints.serving import Generation, WorkerState

# what the built-in engine refuses, and where to go instead (vLLM parses tool calls and
# constrains output; the worker would ignore these fields and answer in plain text)
REFUSALS = {
    "tools": "tools are not supported by the built-in engine (ctxcache worker); "
    "run vLLM with a tool parser: ctxcache serve --engine vllm",
    "tool_choice": "tool_choice is not supported by the built-in engine (ctxcache worker); "
    "run vLLM with a tool parser: ctxcache serve --engine vllm",
    "response_format": "response_format is not supported by the built-in engine "
    "(ctxcache worker); run vLLM: ctxcache serve --engine vllm",
}


def refuse_tools(body: ToolFields) -> None:
    """A 400 naming the engine for tools, a tool_choice or a non-text response_format."""
    field = body.unsupported_field()
    if field is not None:
        raise InvalidRequest(REFUSALS[field], param=field)


def render_chat(tokenizer: Any, body: ChatTemplateFields) -> list[int]:
    """Token ids of the messages rendered by the model's chat template."""
    if body.add_generation_prompt and body.continue_final_message:
        raise InvalidRequest(
            "add_generation_prompt and continue_final_message are exclusive",
            param="continue_final_message",
        )
    try:
        out = tokenizer.apply_chat_template(
            body.rendered_messages(),
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tokenize=True,
        )
    except Exception as exc:  # jinja errors, no template
        raise InvalidRequest(f"cannot render the chat template: {exc}", param="messages") from None
    ids = out["input_ids"] if hasattr(out, "keys") else out
    return [int(t) for t in ids]


def reused_ids(body: ChatCompletionRequest) -> list[int] | None:
    """The prompt given as token ids in `kv_transfer_params.prompt_token_ids`, as vLLM takes
    it (the gateway's agent turns send it so; docs/agents.md): the messages are not
    rendered. Popped, so the rest of `kv_transfer_params` goes on as it is."""
    transfer = body.kv_transfer_params
    if not isinstance(transfer, dict) or "prompt_token_ids" not in transfer:
        return None
    ids = transfer.pop("prompt_token_ids")
    if not isinstance(ids, list) or not ids or any(type(t) is not int or t < 0 for t in ids):
        raise InvalidRequest(
            "kv_transfer_params.prompt_token_ids must be a non-empty list of token ids",
            param="kv_transfer_params.prompt_token_ids",
        )
    return ids


class ChatServing:
    def __init__(self, state: WorkerState) -> None:
        self.state = state

    async def create(
        self, body: ChatCompletionRequest
    ) -> ChatCompletionResponse | StreamingResponse:
        if body.max_completion_tokens is not None and body.max_tokens is None:
            body.max_tokens = body.max_completion_tokens
        refuse_tools(body)
        ids = reused_ids(body) or render_chat(self.state.runner.tokenizer, body)
        gen = Generation.start(self.state, ids, body, default_max_tokens=None)
        if body.stream:
            return sse.stream(self._chunks(body, gen))
        choices = await gen.collect()
        return ChatCompletionResponse(
            model=self.state.model_name,
            choices=[
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content=c.text),
                    finish_reason=c.finish_reason,
                    token_ids=c.token_ids if body.return_token_ids else None,
                )
                for i, c in enumerate(choices)
            ],
            usage=usage(
                gen.prompt_tokens, sum(len(c.token_ids) for c in choices), gen.cached_tokens
            ),
            prompt_token_ids=gen.request.prompt_ids if body.return_token_ids else None,
        )

    async def _chunks(self, body: ChatCompletionRequest, gen: Generation) -> AsyncIterator[str]:
        head = ChatCompletionResponse(model=self.state.model_name, choices=[])
        base = {"id": head.id, "created": head.created, "model": head.model}
        for i in range(body.n):
            first = ChatCompletionChunk(
                **base,
                choices=[
                    ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                ],
                prompt_token_ids=gen.request.prompt_ids
                if body.return_token_ids and i == 0
                else None,
            )
            yield sse.event(first)
        completion_tokens = 0
        async for ev in gen.events():
            completion_tokens += len(ev.token_ids)
            choice = ChatChunkChoice(
                index=ev.index,
                delta=DeltaMessage(content=ev.text),
                finish_reason=ev.finish_reason,
                token_ids=ev.token_ids if body.return_token_ids else None,
            )
            yield sse.event(ChatCompletionChunk(**base, choices=[choice]))
        if body.include_usage:
            yield sse.event(
                ChatCompletionChunk(
                    **base,
                    choices=[],
                    usage=usage(gen.prompt_tokens, completion_tokens, gen.cached_tokens),
                )
            )
