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


def common_suffix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[-1 - i] == b[-1 - i]:
        i += 1
    return i


# a chat rendering: the whole conversation's ids, the window, (if asked for) the ids of the
# history alone, and the new messages
Rendered = tuple[list[int], int, list[int] | None, list[dict[str, Any]]]
# two histories that end with an answer, the last tokens of whose contents differ: what a
# conversation renders after its history is the end it has in common with both (`after`)
PROBES = (
    [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong"}],
    [{"role": "user", "content": "ping"}, {"role": "assistant", "content": "pong!"}],
)
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
        kwargs: dict[str, Any] | None = None,
    ) -> tuple[list[int], int]:
        """`messages` rendered by the model's chat template (with `tools`, which templates
        render into the prefix, and the template's `kwargs`: `gateway.reasoning`) and
        tokenized."""
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "add_generation_prompt": generation_prompt,
        }
        if tools:
            body["tools"] = tools
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        return await self.tokenize(worker, body)

    async def chat_full(
        self,
        worker: Worker,
        model: str,
        previous: list[dict[str, Any]],
        new: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> Rendered:
        """The whole conversation rendered for generation and the model's window — and,
        for a model whose turns lately needed it (see `delta`), the history rendered alone,
        in parallel."""
        whole = self.chat(
            worker, model, previous + new, generation_prompt=True, tools=tools, kwargs=kwargs
        )
        if self._fallbacks.get(model, 0) <= 0 or not previous:  # (nothing renders as nothing)
            full, window = await whole
            return full, window, None, new
        alone = self.chat(
            worker, model, previous, generation_prompt=False, tools=tools, kwargs=kwargs
        )
        (full, window), (before, _) = await asyncio.gather(whole, alone)
        return full, window, before, new

    async def delta(
        self,
        worker: Worker,
        model: str,
        stored: list[int],
        previous: list[dict[str, Any]],
        rendered: Rendered,
        tools: list[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> tuple[list[int], int]:
        """The ids to put after `stored` so the prompt is the whole conversation's, given
        `rendered` = `chat_full(previous, new)`.

        Usually the stored ids are a prefix of the conversation's rendering (an append-only
        template, generated ids that are the text's own tokenization): the rest of it is
        the new part, and the prompt is exactly the full conversation's. Otherwise the
        history's own rendering is needed too; a model whose turns keep needing it (a
        template that rewrites earlier turns, as reasoning models' do) gets both renderings
        in parallel from `chat_full` until FALLBACK_TURNS turns in a row did not. A
        template that renders the history's last answer otherwise once more follows it
        (Qwen3's: an empty `<think>` block on the last answer of an open turn, none on a
        closed one's) is read from the end instead (`after`).
        """
        full, window, before, new = rendered
        if full[: len(stored)] == stored:
            self._fallbacks[model] = max(0, self._fallbacks.get(model, 0) - 1)
            return full[len(stored) :], window
        self._fallbacks[model] = FALLBACK_TURNS
        if before is None and not previous:
            before = []
        elif before is None:
            before, _ = await self.chat(
                worker, model, previous, generation_prompt=False, tools=tools, kwargs=kwargs
            )
        # Templates that rewrite earlier turns (not append-only) keep what still matches.
        new_part = full[common_prefix(full, before) :]
        if full[: len(before)] != before and new:
            closed = await self.after(worker, model, full, new, tools, kwargs)
            if closed is not None:
                new_part = closed
        if stored == before:  # the stored ids already end with a closed turn
            return new_part, window
        closing = await self.closing(worker, model)
        if stored and closing and stored[-1] == closing[0]:
            closing = closing[1:]  # the model generated the end-of-turn id itself
        return closing + new_part, window

    async def after(
        self,
        worker: Worker,
        model: str,
        full: list[int],
        new: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any] | None,
    ) -> list[int] | None:
        """What `full` renders after its history's last answer is closed (its `closing`):
        the end it has in common with `new` rendered after each of the `PROBES`; None if
        that end does not begin with the closing (a template this cannot read)."""
        closing = await self.closing(worker, model)
        renderings = await asyncio.gather(
            *(
                self.chat(
                    worker, model, p + new, generation_prompt=True, tools=tools, kwargs=kwargs
                )
                for p in PROBES
            )
        )
        n = min(common_suffix(full, ids) for ids, _ in renderings)
        tail = full[len(full) - n :]
        if not closing or tail[: len(closing)] != closing:
            return None
        return tail[len(closing) :]

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
