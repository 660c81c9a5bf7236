"""Reasoning in the Responses API, unit by unit: the `reasoning` output item and its usage,
the stream's events (parsed with the openai SDK's own types, in OpenAI's order), the input
reasoning items a client sends back (checked against the stored response they name, with a
fake manager), and what is refused (docs/responses.md, "Reasoning")."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from cache_manager.protocol import ResponseRecord
from ctxcache.errors import InvalidRequest, SessionNotFound
from gateway.reasoning import Reasoning
from gateway.responses.protocol import ResponseCreate, new_response_id
from gateway.responses.reasoning import (
    check_reasoning_fields,
    check_reasoning_input,
    reasoning_echo,
    reasoning_fields,
    reasoning_id,
    reasoning_tokens,
)
from gateway.responses.shaping import (
    REQUEST_FIELDS,
    ResponseDraft,
    ResponseEvents,
    failed_object,
    replay_events,
)

SID = "ctx_" + "a" * 32
QWEN3 = Reasoning("qwen3")
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
USAGE = {
    "prompt_tokens": 40,
    "completion_tokens": 12,
    "prompt_tokens_details": {"cached_tokens": 32},
}
# what the planner puts in a draft (every field of REQUEST_FIELDS)
REQUEST: dict[str, Any] = {
    "instructions": None,
    "max_output_tokens": None,
    "metadata": {},
    "previous_response_id": None,
    "conversation": None,
    "store": True,
    "temperature": 1.0,
    "top_p": 1.0,
    "service_tier": "default",
    "tools": [],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "text": {"format": {"type": "text"}},
    "reasoning": {"effort": "low", "summary": None},
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


assert set(REQUEST) == set(REQUEST_FIELDS)


def draft(response_id: str | None = None) -> ResponseDraft:
    rid = response_id or new_response_id(SID)
    return ResponseDraft(id=rid, model="m", output_id="msg_" + "0" * 40, request=REQUEST)


def parsed(stream: bytes) -> list[Any]:
    """The SSE events, each checked against the openai SDK's event types."""
    out = []
    for block in stream.split(b"\n\n"):
        if not block:
            continue
        head, data = block.split(b"\n", 1)
        event = EVENTS.validate_python(orjson.loads(data.removeprefix(b"data: ")))
        assert head == b"event: " + event.type.encode()
        out.append(event)
    assert [e.sequence_number for e in out] == list(range(len(out)))
    return out


def test_a_finished_response_has_its_reasoning_item_first() -> None:
    d = draft()
    message = {"role": "assistant", "content": "sunny", "tool_calls": [CALL]}
    obj = d.object(
        text="sunny",
        usage=USAGE,
        message=message,
        reasoning="let me think",
        reasoning_tokens=5,
    )
    r = Response.model_validate(obj)
    assert r.reasoning is not None and r.reasoning.effort == "low"
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message", "function_call"]
    item = r.output[0]
    assert item.type == "reasoning" and item.id == "rs_" + d.id.removeprefix("resp_")
    assert item.summary == [] and item.content is not None
    assert [(c.type, c.text) for c in item.content] == [("reasoning_text", "let me think")]
    assert item.encrypted_content is None and item.status == "completed"
    assert r.output_text == "sunny"  # (the reasoning is not output text)
    assert r.usage is not None and r.usage.output_tokens_details.reasoning_tokens == 5
    # no reasoning: no item, 0 reasoning tokens
    plain = Response.model_validate(d.object(text="sunny", usage=USAGE))
    assert [i.type for i in plain.output] == ["message"]
    assert plain.usage is not None and plain.usage.output_tokens_details.reasoning_tokens == 0


def test_an_incomplete_response_marks_its_reasoning_incomplete() -> None:
    obj = draft().object(text="", finish_reason="length", usage=USAGE, reasoning="and so")
    assert obj["status"] == "incomplete"
    assert [(i["type"], i["status"]) for i in obj["output"]] == [
        ("reasoning", "incomplete"),
        ("message", "incomplete"),
    ]


def chunk(**delta: Any) -> dict[str, Any]:
    return {"index": 0, "delta": delta}


def test_the_stream_sends_reasoning_then_the_answer_in_openais_order() -> None:
    d = draft()
    events = ResponseEvents(d)
    stream = events.start()
    for piece in ("let ", "me ", "think"):
        stream += events.content(chunk(reasoning=piece))
    stream += events.content(chunk(content="sun"))
    stream += events.content(chunk(content="ny"))
    final = d.object(text="sunny", usage=USAGE, reasoning="let me think", reasoning_tokens=3)
    stream += events.usage(USAGE, final)
    got = parsed(stream)
    rid, mid = d.reasoning_id, d.output_id
    seen = [(e.type, getattr(e, "item_id", None), getattr(e, "output_index", None)) for e in got]
    assert seen == [
        ("response.created", None, None),
        ("response.in_progress", None, None),
        ("response.output_item.added", None, 0),
        ("response.content_part.added", rid, 0),
        ("response.reasoning_text.delta", rid, 0),
        ("response.reasoning_text.delta", rid, 0),
        ("response.reasoning_text.delta", rid, 0),
        # the reasoning item is done before the message begins
        ("response.reasoning_text.done", rid, 0),
        ("response.content_part.done", rid, 0),
        ("response.output_item.done", None, 0),
        ("response.output_item.added", None, 1),
        ("response.content_part.added", mid, 1),
        ("response.output_text.delta", mid, 1),
        ("response.output_text.delta", mid, 1),
        ("response.output_text.done", mid, 1),
        ("response.content_part.done", mid, 1),
        ("response.output_item.done", None, 1),
        ("response.completed", None, None),
    ]
    added, part = got[2], got[3]
    assert added.item.type == "reasoning" and added.item.id == rid
    assert added.item.status == "in_progress"
    assert part.part.type == "reasoning_text" and part.part.text == ""
    assert "".join(e.delta for e in got if e.type == "response.reasoning_text.delta") == (
        "let me think"
    )
    assert got[7].text == "let me think" and got[8].part.text == "let me think"
    assert got[9].item.model_dump(exclude_none=True) == final["output"][0]
    assert got[-1].response.output[0].id == rid
    assert got[-1].response.usage.output_tokens_details.reasoning_tokens == 3


def test_reasoning_before_a_function_call_is_done_before_the_call_is_added() -> None:
    d = draft()
    events = ResponseEvents(d)
    stream = events.start() + events.content(chunk(reasoning="hmm"))
    call = {"index": 0, "id": "call_1", "function": {"name": "get_weather", "arguments": "{}"}}
    stream += events.content(chunk(tool_calls=[call]))
    message = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    final = d.object(text="", usage=USAGE, message=message, reasoning="hmm")
    stream += events.usage(USAGE, final)
    got = [(e.type, getattr(e, "output_index", None)) for e in parsed(stream)]
    assert got[2:] == [
        ("response.output_item.added", 0),
        ("response.content_part.added", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.done", 1),
        ("response.output_item.done", 1),
        ("response.completed", None),
    ]


def test_a_stream_cut_while_reasoning_closes_its_item_incomplete() -> None:
    d = draft()
    events = ResponseEvents(d)
    stream = events.start() + events.content(chunk(reasoning="and so"))
    final = d.object(text="", finish_reason="length", usage=USAGE, reasoning="and so")
    stream += events.usage(USAGE, final)
    got = parsed(stream)
    done = [e for e in got if e.type == "response.output_item.done"]
    assert [(e.output_index, e.item.type, e.item.status) for e in done] == [
        (0, "reasoning", "incomplete"),
        (1, "message", "incomplete"),
    ]
    assert got[-1].type == "response.incomplete"


def test_a_replayed_stream_has_the_live_streams_events() -> None:
    d = draft()
    events = ResponseEvents(d)
    live = events.start() + events.content(chunk(reasoning="let me think"))
    live += events.content(chunk(content="sunny"))
    final = d.object(text="sunny", usage=USAGE, reasoning="let me think")
    live += events.usage(USAGE, final)
    again = b"".join(replay_events(final))
    assert again == live


def test_a_failed_stream_keeps_the_reasoning_streamed_so_far() -> None:
    d = draft()
    events = ResponseEvents(d)
    stream = events.start() + events.content(chunk(reasoning="hm"))
    stream += events.failed(RuntimeError("gone"))
    failed = next(e for e in parsed(stream) if e.type == "response.failed").response
    assert [(i.type, i.status) for i in failed.output] == [
        ("reasoning", "incomplete"),
        ("message", "incomplete"),
    ]
    assert failed.output[0].content[0].text == "hm"
    assert failed_object(d, "", "x")["output"][0]["type"] == "message"  # (none: no item)


# -- the request ---------------------------------------------------------------------------


def request(**body: Any) -> ResponseCreate:
    return ResponseCreate.model_validate({"model": "m", "input": "hi", **body})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        (
            {
                "input": [
                    {"role": "user", "content": "hi"},
                    {"type": "reasoning", "id": "rs_x", "summary": [], "encrypted_content": "e"},
                ]
            },
            "input[1].encrypted_content",
        ),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ],
)
def test_what_is_not_supported_is_refused_naming_the_param(
    body: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_reasoning_fields(request(**body), QWEN3)
    assert refused.value.param == param
    if param != "reasoning.effort":
        assert "not supported" in refused.value.message
    else:
        assert refused.value.message.startswith("reasoning.effort must be one of none,")


def test_thinking_asked_without_a_reasoning_parser_is_refused() -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_reasoning_fields(request(reasoning={"effort": "high"}), Reasoning())
    assert refused.value.param == "reasoning.effort"
    assert "no reasoning parser" in refused.value.message
    check_reasoning_fields(request(reasoning={"effort": "none"}), Reasoning())  # (off: fine)


def test_the_effort_reaches_the_chat_turn_and_is_echoed() -> None:
    req = request(reasoning={"effort": "low", "summary": "auto"})
    check_reasoning_fields(req, QWEN3)
    assert reasoning_fields(req) == {"reasoning_effort": "low"}
    assert reasoning_echo(req) == {"effort": "low", "summary": "auto"}
    assert reasoning_fields(request()) == {}
    assert reasoning_echo(request()) == {"effort": None, "summary": None}


class Manager:
    """Stored responses by field, for one tenant; counts its reads."""

    def __init__(self, tenant: str, responses: dict[str, dict[str, Any]]) -> None:
        self.tenant = tenant
        self.responses = responses
        self.reads = 0

    async def get_response(self, session_id: str, tenant: str, field: str) -> ResponseRecord:
        self.reads += 1
        if tenant != self.tenant or field not in self.responses or session_id != SID:
            raise SessionNotFound("gone")
        at = {"version": 1, "tokens": 1, "messages": 1}
        return ResponseRecord(record={"response": self.responses[field], "at": at}, version=1)


def stored_turn(text: str = "sunny") -> tuple[Manager, dict[str, Any]]:
    d = draft()
    message = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    final = d.object(text="", usage=USAGE, message=message, reasoning=text)
    return Manager("t", {d.id[-16:]: final}), final


def echoed(final: dict[str, Any], **reasoning: Any) -> list[dict[str, Any]]:
    """A whole conversation as the Agents SDK sends it back: the input, the response's
    output items as they came, the call's output."""
    items = [dict(item) for item in final["output"]]
    items[0] = {**items[0], **reasoning}
    return [
        {"role": "user", "content": "paris?"},
        *items,
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]


async def test_a_reasoning_item_sent_back_becomes_its_messages_reasoning() -> None:
    manager, final = stored_turn("let me think")
    req = request(input=echoed(final))
    check_reasoning_fields(req, QWEN3)
    await check_reasoning_input(manager, "t", req)  # type: ignore[arg-type]
    assert req.messages() == [
        {"role": "user", "content": "paris?"},
        {"role": "assistant", "content": None, "reasoning": "let me think", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    # sent without its text (an id and an empty summary): the stored text
    bare = request(input=echoed(final, content=None))
    await check_reasoning_input(manager, "t", bare)  # type: ignore[arg-type]
    assert bare.messages()[1]["reasoning"] == "let me think"


async def test_a_reasoning_item_with_its_message_joins_that_message() -> None:
    d = draft()
    final = d.object(text="sunny", usage=USAGE, reasoning="so")
    manager = Manager("t", {d.id[-16:]: final})
    items = [{"role": "user", "content": "hi"}, *final["output"], {"role": "user", "content": "?"}]
    req = request(input=items)
    await check_reasoning_input(manager, "t", req)  # type: ignore[arg-type]
    assert req.messages()[1] == {"role": "assistant", "content": "sunny", "reasoning": "so"}
    assert len(req.messages()) == 3


@pytest.mark.parametrize(
    ("edit", "param"),
    [
        ("other text", "input[1].content"),
        ("other call", "input[1]"),
        ("no answer", "input[1]"),
        ("unknown id", "input[1]"),
        ("not ours", "input[1]"),
        ("other tenant", "input[1]"),
    ],
)
async def test_a_reasoning_item_that_does_not_belong_is_refused(edit: str, param: str) -> None:
    manager, final = stored_turn("let me think")
    items = echoed(final)
    tenant = "t"
    if edit == "other text":
        items[1] = {**items[1], "content": [{"type": "reasoning_text", "text": "I was told"}]}
    elif edit == "other call":
        items[2] = {**items[2], "arguments": '{"city": "rome"}'}
    elif edit == "no answer":
        del items[2]
    elif edit == "unknown id":
        items[1] = {**items[1], "id": reasoning_id(new_response_id(SID))}
    elif edit == "not ours":
        items[1] = {**items[1], "id": "rs_68af3b2c"}
    else:
        tenant = "u"
    reads = 0 if edit == "not ours" else 1
    with pytest.raises(InvalidRequest) as refused:
        await check_reasoning_input(manager, tenant, request(input=items))  # type: ignore[arg-type]
    assert refused.value.param == param, refused.value.message
    assert manager.reads == reads


async def test_one_read_per_response_named() -> None:
    manager, final = stored_turn()
    items = echoed(final)
    await check_reasoning_input(manager, "t", request(input=[*items, *items[1:]]))  # type: ignore[arg-type]
    assert manager.reads == 1


class Prompts:
    def __init__(self) -> None:
        self.texts: list[str] = []

    async def text(self, worker: Any, model: str, prompt: str, *, special: bool) -> Any:
        assert not special
        self.texts.append(prompt)
        return list(range(len(prompt.split()))), 4096


async def test_reasoning_tokens_are_the_engines_count_else_the_texts() -> None:
    prompts = Prompts()
    engine = {**USAGE, "completion_tokens_details": {"reasoning_tokens": 7}}
    worker = object()
    assert await reasoning_tokens(prompts, worker, "m", engine, "a b c") == 7  # type: ignore[arg-type]
    assert prompts.texts == []
    assert await reasoning_tokens(prompts, worker, "m", USAGE, "a b c") == 3  # type: ignore[arg-type]
    assert prompts.texts == ["a b c"]
    assert await reasoning_tokens(prompts, worker, "m", USAGE, None) == 0  # type: ignore[arg-type]
    many = " ".join(["x"] * 30)  # never more than the output tokens
    assert await reasoning_tokens(prompts, worker, "m", USAGE, many) == 12  # type: ignore[arg-type]
