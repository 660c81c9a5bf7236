"""The Responses API's objects and stream events, from a turn's generation."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from ctxcache.errors import CtxError
from gateway.responses.items import call_item_id, items_of, message_item, message_of_call
from gateway.responses.reasoning import reasoning_id, reasoning_item
from gateway.shaping import cached_tokens


def response_usage(usage: dict[str, Any], reasoning: int = 0) -> dict[str, Any]:
    """Chat usage in the Responses shape. `cache_write_tokens`: the prompt tokens whose KV
    this turn computed and cached (the ones not read from the cache); `reasoning`: the
    output tokens that were reasoning (`gateway.responses.reasoning.reasoning_tokens`)."""
    prompt, out = int(usage["prompt_tokens"]), int(usage["completion_tokens"])
    cached = cached_tokens(usage)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": prompt - cached},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + out,
    }


@dataclass(frozen=True)
class Page:
    """Which part of a list to answer: OpenAI's `limit`, `after` and `order` (the list
    endpoints' query, `gateway.responses.router.PageDep`)."""

    limit: int = 20
    after: str | None = None
    order: str = "desc"

    def of(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        """OpenAI's cursor page over items (oldest first in `items`)."""
        ordered = items if self.order == "asc" else items[::-1]
        if self.after is not None:
            ids = [i["id"] for i in ordered]
            ordered = ordered[ids.index(self.after) + 1 :] if self.after in ids else []
        page = ordered[: self.limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(ordered) > self.limit,
        }


@dataclass
class ResponseDraft:
    """A response before its text is known: everything the request fixed, and its ids."""

    id: str
    model: str
    output_id: str
    request: dict[str, Any]  # instructions, sampling, metadata, previous id, conversation
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def reasoning_id(self) -> str:
        return reasoning_id(self.id)

    def object(
        self,
        *,
        text: str | None,
        finish_reason: str | None = None,
        usage: dict[str, Any] | None = None,
        message: dict[str, Any] | None = None,
        reasoning: str | None = None,
        reasoning_tokens: int = 0,
    ) -> dict[str, Any]:
        """The response object: in progress (`text` None) or finished; `message`: the
        answer's assistant message, with its tool calls (default: `text` alone);
        `reasoning`: the model's reasoning before it, as a `reasoning` item first."""
        done = text is not None
        incomplete = done and finish_reason == "length"
        status = "incomplete" if incomplete else "completed" if done else "in_progress"
        item_status = "incomplete" if incomplete else "completed"
        answer = message or {"role": "assistant", "content": text or ""}
        output = items_of(answer, self.output_id, item_status) if done else []
        if done and reasoning:
            output.insert(0, reasoning_item(self.reasoning_id, reasoning, item_status))
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": True,
            "reasoning": {"effort": None, "summary": None},
            "text": {"format": {"type": "text"}},
            "tool_choice": "auto",
            "tools": [],
            "truncation": "disabled",
            "usage": response_usage(usage, reasoning_tokens) if usage is not None else None,
            "user": None,
            **self.request,
        }


# the request's fields a response object repeats (ResponseDraft.request)
REQUEST_FIELDS = (
    "instructions",
    "max_output_tokens",
    "metadata",
    "previous_response_id",
    "conversation",
    "store",
    "temperature",
    "top_p",
    "service_tier",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "reasoning",
)


def failed_object(
    draft: ResponseDraft, text: str, message: str, reasoning: str | None = None
) -> dict[str, Any]:
    """A response that failed mid-way: `failed`, with OpenAI's error, and its output so far
    marked `incomplete` (it is not stored: the turn appended nothing)."""
    out = draft.object(text=text, reasoning=reasoning)
    out["status"] = "failed"
    out["incomplete_details"] = None
    out["usage"] = None
    out["error"] = {"code": "server_error", "message": message}
    for item in out["output"]:
        item["status"] = "incomplete"
    return out


def draft_of(final: dict[str, Any]) -> ResponseDraft:
    """The draft a finished response was made from (to stream it again)."""
    first = next(i["id"] for i in final["output"] if i["type"] != "reasoning")
    return ResponseDraft(
        id=final["id"],
        model=final["model"],
        output_id=message_of_call(first) if first.startswith("fc_") else first,
        request={k: final.get(k) for k in REQUEST_FIELDS},
        created_at=final["created_at"],
    )


def replay_events(final: dict[str, Any]) -> list[bytes]:
    """A recorded response as the stream that made it: its reasoning in one delta, its
    text in one, each call's arguments in one."""
    events = ResponseEvents(draft_of(final))
    out = [events.start()]
    for item in final["output"]:
        if item["type"] == "reasoning":
            text = "".join(p["text"] for p in item["content"])
            out.append(events.content({"delta": {"reasoning": text}}))
        elif item["type"] == "message" and item["content"]:
            out.append(events.content({"text": item["content"][0]["text"]}))
        elif item["type"] == "function_call":
            k = int(item["id"].rsplit("_", 1)[1])
            call = {"index": k, "id": item["call_id"], "function": item}
            out.append(events.content({"delta": {"tool_calls": [call]}}))
    return [*out, events.usage(final["usage"], final)]


class ResponseEvents:
    """The Responses SSE sequence around a worker's stream (`gateway.shaping.Shaper`):
    created, in_progress; then per output item as it starts (the reasoning, the message's
    text, each function call): output_item.added (and content_part.added), its deltas
    (reasoning_text.delta / output_text.delta / function_call_arguments.delta). The
    reasoning item is done (reasoning_text.done, content_part.done, output_item.done) when
    the answer after it begins, as OpenAI's is; at the end, per item left, its .done events
    and output_item.done; then completed (with usage)."""

    end = b""

    def __init__(self, draft: ResponseDraft) -> None:
        self.draft = draft
        self.seq = 0
        self.text: list[str] = []
        self.opened: list[str] = []  # item ids, in the order their items were added
        self.arguments: dict[str, list[str]] = {}  # function call item id -> pieces
        self.reasoning: list[str] = []
        self.reasoning_done = False  # (its item closed: the answer after it began)

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def _where(self) -> dict[str, Any]:
        index = self.opened.index(self.draft.output_id)
        return {"item_id": self.draft.output_id, "output_index": index, "content_index": 0}

    def start(self) -> bytes:
        started = self.draft.object(text=None)
        return b"".join(
            [
                self._event("response.created", response=started),
                self._event("response.in_progress", response=started),
            ]
        )

    def _open_message(self) -> bytes:
        self.opened.append(self.draft.output_id)
        item = message_item(self.draft.output_id, "assistant", "", status="in_progress")
        return b"".join(
            [
                self._event(
                    "response.output_item.added", output_index=len(self.opened) - 1, item=item
                ),
                self._event(
                    "response.content_part.added",
                    **self._where(),
                    part={"type": "output_text", "text": "", "annotations": []},
                ),
            ]
        )

    def _reasoning_where(self) -> dict[str, Any]:
        index = self.opened.index(self.draft.reasoning_id)
        return {"item_id": self.draft.reasoning_id, "output_index": index, "content_index": 0}

    def _reasoning_delta(self, piece: str) -> bytes:
        out: list[bytes] = []
        rid = self.draft.reasoning_id
        if rid not in self.opened:
            self.opened.append(rid)
            item = {**reasoning_item(rid, ""), "content": [], "status": "in_progress"}
            index = len(self.opened) - 1
            part = {"type": "reasoning_text", "text": ""}
            out += [
                self._event("response.output_item.added", output_index=index, item=item),
                self._event("response.content_part.added", **self._reasoning_where(), part=part),
            ]
        self.reasoning.append(piece)
        where = self._reasoning_where()
        out.append(self._event("response.reasoning_text.delta", **where, delta=piece))
        return b"".join(out)

    def _reasoning_closed(self, item: dict[str, Any] | None = None) -> bytes:
        """The reasoning item's closing events (`item`: as the response has it; default:
        the text streamed, completed), once, if it was opened."""
        if self.draft.reasoning_id not in self.opened or self.reasoning_done:
            return b""
        self.reasoning_done = True
        text = "".join(self.reasoning)
        if item is not None:
            text = "".join(p["text"] for p in item["content"])
        where = self._reasoning_where()
        part = {"type": "reasoning_text", "text": text}
        done = item or reasoning_item(self.draft.reasoning_id, text)
        return b"".join(
            [
                self._event("response.reasoning_text.done", **where, text=text),
                self._event("response.content_part.done", **where, part=part),
                self._event(
                    "response.output_item.done", output_index=where["output_index"], item=done
                ),
            ]
        )

    def content(self, choice: dict[str, Any]) -> bytes:
        delta = choice.get("delta")
        text = (delta.get("content") if delta is not None else choice.get("text")) or ""
        out: list[bytes] = []
        # (reasoning after the answer began, which no parser here gives, is left out of the
        # events; the finished response has all of it)
        if (piece := (delta or {}).get("reasoning")) and not self.reasoning_done:
            out.append(self._reasoning_delta(piece))
        if text or (delta or {}).get("tool_calls"):
            out.append(self._reasoning_closed())
        if text:
            if self.draft.output_id not in self.opened:
                out.append(self._open_message())
            self.text.append(text)
            out.append(
                self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[])
            )
        for call in (delta or {}).get("tool_calls") or ():
            out.append(self._call_delta(call))
        return b"".join(out)

    def _call_delta(self, call: dict[str, Any]) -> bytes:
        item_id = call_item_id(self.draft.output_id, int(call.get("index") or 0))
        fn = call.get("function") or {}
        out: list[bytes] = []
        if item_id not in self.arguments:
            self.opened.append(item_id)
            self.arguments[item_id] = []
            item = {
                "id": item_id,
                "type": "function_call",
                "call_id": call.get("id"),
                "name": fn.get("name"),
                "arguments": "",
                "status": "in_progress",
            }
            index = len(self.opened) - 1
            out.append(self._event("response.output_item.added", output_index=index, item=item))
        if piece := fn.get("arguments"):
            self.arguments[item_id].append(piece)
            index = self.opened.index(item_id)
            out.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item_id,
                    output_index=index,
                    delta=piece,
                )
            )
        return b"".join(out)

    def failed(self, exc: Exception) -> bytes:
        """The end of a stream whose turn failed after it started (a worker that died, a
        commit the store refused): `response.failed`, then an `error` event, which the
        openai SDK raises as an `APIError` with the code and message."""
        err = exc if isinstance(exc, CtxError) else CtxError()
        message = f"the response failed while streaming: {err.message}"
        reasoning = "".join(self.reasoning) or None
        failed = failed_object(self.draft, "".join(self.text), message, reasoning)
        error = {"type": err.type, "code": err.code, "message": message, "param": None}
        return b"".join(
            [
                self._event("response.failed", response=failed),
                self._event("error", code=err.code, message=message, param=None, error=error),
            ]
        )

    def usage(self, usage: dict[str, Any], final: dict[str, Any]) -> bytes:
        """The closing events of every item; `final` is the finished response object (as
        stored). An item the stream never added (an answer with no text) is added now."""
        out: list[bytes] = []
        for index, item in enumerate(final["output"]):
            if item["type"] == "reasoning":
                if item["id"] not in self.opened:  # (no reasoning was streamed)
                    out.append(self._reasoning_delta("".join(p["text"] for p in item["content"])))
                out.append(self._reasoning_closed(item))
                continue
            if item["type"] == "message":
                if item["id"] not in self.opened:
                    out.append(self._open_message())
                text = "".join(self.text)
                where = self._where()
                part = {"type": "output_text", "text": text, "annotations": []}
                out += [
                    self._event("response.output_text.done", **where, text=text, logprobs=[]),
                    self._event("response.content_part.done", **where, part=part),
                ]
            elif item["type"] == "function_call":
                if item["id"] not in self.arguments:
                    call = {"index": int(item["id"].rsplit("_", 1)[1]), "id": item["call_id"]}
                    out.append(self._call_delta({**call, "function": {"name": item["name"]}}))
                out.append(
                    self._event(
                        "response.function_call_arguments.done",
                        item_id=item["id"],
                        output_index=index,
                        arguments=item["arguments"],
                    )
                )
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        last = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        out.append(self._event(last, response=final))
        return b"".join(out)
