"""Building a session turn's prompt as token ids, exactly as the full conversation would be.

The stored token ids of a session are the truth and are always kept as the prefix: the
ids the model generated are never re-tokenized from their text (which need not round
trip). Only the newly rendered part is tokenized:

* completion sessions: the new prompt's text, without special tokens;
* chat sessions: the chat template rendered over (previous messages + new messages) with
  the generation prompt. When the stored ids are a prefix of it (the usual case: an
  append-only template, and generated ids that are their text's own tokenization), the
  rest of it is the new part, and the prompt is exactly the full conversation's — one
  `/tokenize` call. Otherwise the previous messages are rendered alone too and the new
  part is what follows them; if the stored ids end inside an assistant reply, the
  template's end-of-turn tokens come first (learned once per model from a probe
  conversation), without repeating an end-of-turn id the model generated itself.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ctxcache.errors import InvalidRequest
from gateway.pool import Worker
from gateway.upstream import post_json


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the usual case, compared in C
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# a chat rendering: the whole conversation's ids, the window, and (if asked for) the ids of
# the history alone
Rendered = tuple[list[int], int, list[int] | None]
FALLBACK_TURNS = 32


class PromptBuilder:
    def __init__(self) -> None:
        self._closing: dict[str, list[int]] = {}  # model -> end-of-assistant-turn ids
        # model -> turns left rendering the history alone in parallel (see `delta`)
        self._fallbacks: dict[str, int] = {}

    async def tokenize(self, worker: Worker, body: dict[str, Any]) -> tuple[list[int], int]:
        """Token ids and the model's max_model_len, from the worker's `/tokenize`."""
        out = await post_json(worker, "/tokenize", body)
        return list(out["tokens"]), int(out.get("max_model_len") or 0)

    async def text(
        self, worker: Worker, model: str, prompt: str | list[int], *, special: bool
    ) -> tuple[list[int], int]:
        if isinstance(prompt, list):
            return list(prompt), worker.models.get(model, 0)
        return await self.tokenize(
            worker, {"model": model, "prompt": prompt, "add_special_tokens": special}
        )

    async def chat(
        self,
        worker: Worker,
        model: str,
        messages: list[dict[str, Any]],
        *,
        generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[list[int], int]:
        """`messages` rendered by the model's chat template (with `tools`, which templates
        render into the prefix) and tokenized."""
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "add_generation_prompt": generation_prompt,
        }
        if tools:
            body["tools"] = tools
        return await self.tokenize(worker, body)

    async def chat_full(
        self,
        worker: Worker,
        model: str,
        previous: list[dict[str, Any]],
        new: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
    ) -> Rendered:
        """The whole conversation rendered for generation and the model's window — and,
        for a model whose turns lately needed it (see `delta`), the history rendered alone,
        in parallel."""
        whole = self.chat(worker, model, previous + new, generation_prompt=True, tools=tools)
        if self._fallbacks.get(model, 0) <= 0 or not previous:  # (nothing renders as nothing)
            full, window = await whole
            return full, window, None
        (full, window), (before, _) = await asyncio.gather(
            whole, self.chat(worker, model, previous, generation_prompt=False, tools=tools)
        )
        return full, window, before

    async def delta(
        self,
        worker: Worker,
        model: str,
        stored: list[int],
        previous: list[dict[str, Any]],
        rendered: Rendered,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[list[int], int]:
        """The ids to put after `stored` so the prompt is the whole conversation's, given
        `rendered` = `chat_full(previous, new)`.

        Usually the stored ids are a prefix of the conversation's rendering (an append-only
        template, generated ids that are the text's own tokenization): the rest of it is
        the new part, and the prompt is exactly the full conversation's. Otherwise the
        history's own rendering is needed too; a model whose turns keep needing it (a
        template that rewrites earlier turns, as reasoning models' do) gets both renderings
        in parallel from `chat_full` until FALLBACK_TURNS turns in a row did not.
        """
        full, window, before = rendered
        if full[: len(stored)] == stored:
            self._fallbacks[model] = max(0, self._fallbacks.get(model, 0) - 1)
            return full[len(stored) :], window
        self._fallbacks[model] = FALLBACK_TURNS
        if before is None and not previous:
            before = []
        elif before is None:
            before, _ = await self.chat(
                worker, model, previous, generation_prompt=False, tools=tools
            )
        # Templates that rewrite earlier turns (not append-only) keep what still matches.
        new_part = full[common_prefix(full, before) :]
        if stored == before:  # the stored ids already end with a closed turn
            return new_part, window
        closing = await self.closing(worker, model)
        if stored and closing and stored[-1] == closing[0]:
            closing = closing[1:]  # the model generated the end-of-turn id itself
        return closing + new_part, window

    async def closing(self, worker: Worker, model: str) -> list[int]:
        """The template's ids after an assistant message's content (e.g. `<|im_end|>\\n`)."""
        if model not in self._closing:
            probe = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}]
            (open_, _), (closed, _) = await asyncio.gather(
                self.tokenize(
                    worker,
                    {
                        "model": model,
                        "messages": probe,
                        "add_generation_prompt": False,
                        "continue_final_message": True,
                    },
                ),
                self.chat(worker, model, probe, generation_prompt=False),
            )
            if closed[: len(open_)] != open_:
                raise InvalidRequest("this model's chat template cannot continue a session")
            self._closing[model] = closed[len(open_) :]
        return self._closing[model]
