"""A conversation's first request (an implicit session's miss, docs/implicit.md): it goes to
the engine's chat endpoint as it is — so it costs the gateway what a pass-through costs —
with two fields more: its new session's KV tag (`kv_transfer_params`, so the engine stores
its KV for the next request) and `return_token_ids` (so the state keeps the exact ids the
engine read and generated). The answer goes back without what the client did not ask for
(the ids, and the empty chunks vLLM streams only to carry them); `FirstRequest` reads the
answer message and the ids on the way, and the new session is written after the answer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from gateway.pool import Worker
from gateway.tools import StreamedCalls, assistant_message

_MAX_EVENT = 2**20  # (an event longer than this: the tap lets the rest pass untouched)


class FirstRequest:
    def __init__(
        self,
        kv_key: str,
        wants_ids: bool,
        done: Callable[[FirstRequest, Worker], None],
    ) -> None:
        self.kv_key = kv_key
        self.wants_ids = wants_ids  # the client asked for the ids itself: they stay
        self.done_with = done
        self.prompt_ids: list[int] | None = None
        self.ids: list[int] = []
        self.text: list[str] = []
        self.reasoning: list[str] = []  # a thinking model's (docs/reasoning.md)
        self.calls = StreamedCalls()
        self.message: dict[str, Any] | None = None  # the whole answer's, not streamed
        self.finished = False
        self.rest = b""
        self.off = False
        self.affinity: str | None = None  # the worker it should go to (its prompt_cache_key's)
        self.worker: Worker | None = None  # a stream's worker
        self.kept = False

    # -- the request -------------------------------------------------------------------
    def engine_raw(self, raw: bytes, doc: dict[str, Any]) -> bytes:
        """The request's bytes with the KV tag and `return_token_ids`, added at the end of
        the object as they are (the body has no `kv_transfer_params`: `renders_alike`)."""
        extra = b',"kv_transfer_params":{"lmcache.tag.s":"%b"}' % self.kv_key.encode()
        if not doc.get("return_token_ids"):
            extra += b',"return_token_ids":true'
        end = raw.rindex(b"}")
        return raw[:end] + extra + raw[end:]

    # -- the answer in one piece --------------------------------------------------------
    def answer(self, payload: bytes, worker: Worker) -> bytes:
        """The engine's answer as the client gets it; the state is kept after it."""
        try:
            doc = orjson.loads(payload)
            choice = doc["choices"][0]
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            return payload  # (not an answer we can read: nothing is kept)
        self.prompt_ids = doc.get("prompt_token_ids")
        self.ids = list(choice.get("token_ids") or ())
        self.message = choice.get("message") or {}
        self.finished = True
        if not self.wants_ids:  # (as the engine writes a field nobody asked for: null)
            doc["prompt_token_ids"] = None
            for c in doc["choices"]:
                c["token_ids"] = None
            payload = orjson.dumps(doc)
        self.done_with(self, worker)
        return payload

    # -- a stream -----------------------------------------------------------------------
    def feed(self, chunk: bytes) -> bytes:
        """What to pass on of a stream's `chunk`: its whole events, each without the ids
        (and not at all if it carried nothing else)."""
        if self.off:
            return chunk
        data = self.rest + chunk
        end = data.rfind(b"\n\n") + 2
        if end < 2:
            if len(data) > _MAX_EVENT:
                self.off, self.rest = True, b""
                return data
            self.rest = data
            return b""
        self.rest = data[end:]
        return b"".join(self._event(e) for e in data[:end].split(b"\n\n") if e)

    def _event(self, event: bytes) -> bytes:
        if event == b"data: [DONE]" and self.worker is not None:
            self._keep(self.worker)  # (before the client has the end)
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return event + b"\n\n"
        try:
            doc = orjson.loads(event[6:])
        except orjson.JSONDecodeError:
            return event + b"\n\n"
        if "prompt_token_ids" in doc and self.prompt_ids is None:
            self.prompt_ids = doc["prompt_token_ids"]
        empty = bool(doc.get("choices"))
        for choice in doc.get("choices") or ():
            self.ids.extend(choice.get("token_ids") or ())
            delta = choice.get("delta") or {}
            self.text.append(delta.get("content") or "")
            self.reasoning.append(delta.get("reasoning") or "")
            self.calls.add(delta.get("tool_calls"))
            if choice.get("finish_reason") is not None:
                self.finished = True
            if delta or choice.get("finish_reason") is not None or choice.get("logprobs"):
                empty = False
        if self.wants_ids:
            return event + b"\n\n"
        if empty:  # (sent only for its ids: a client that did not ask gets no such chunk)
            return b""
        doc.pop("prompt_token_ids", None)
        for choice in doc.get("choices") or ():
            choice.pop("token_ids", None)
        return b"data: " + orjson.dumps(doc) + b"\n\n"

    def end(self, worker: Worker) -> bytes:
        """The stream ended (whole): what is left of it; the state is kept after it (if
        its `[DONE]` did not already keep it)."""
        rest, self.rest = self.rest, b""
        self._keep(worker)
        return rest

    def _keep(self, worker: Worker) -> None:
        if self.finished and not self.off and not self.kept:
            self.kept = True
            self.done_with(self, worker)

    # -- what the state keeps -----------------------------------------------------------
    def assistant(self) -> dict[str, Any]:
        """The answer's message, as the history keeps it."""
        if self.message is not None:
            return assistant_message(self.message)
        calls = self.calls.list()
        text = "".join(self.text)
        content = text if text or not calls else None
        reasoning = "".join(self.reasoning)
        return assistant_message({"content": content, "tool_calls": calls, "reasoning": reasoning})

    def tokens(self) -> list[int]:
        """The prompt's ids and the answer's: the session's; [] if the engine gave none
        (then the next turn renders the history from its messages)."""
        if not self.prompt_ids or not self.ids:  # (an engine that hid the answer's ids)
            return []
        return [*self.prompt_ids, *self.ids]
