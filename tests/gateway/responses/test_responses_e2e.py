"""OpenAI's stateful APIs through the official openai SDK: Responses with
`previous_response_id` (chains, forks, streaming) and Conversations, on real processes."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response

from tests.gateway.conftest import SDK, Stack

DOC = " ".join(
    f"Section {i}: the cache keeps the history of every turn on the server." for i in range(40)
)
INSTRUCTIONS = "You answer from this document. " + DOC
QUESTIONS = ["What does the cache keep?", "Where is it kept?", "For how long?", "And then?"]
GREEDY: dict[str, Any] = {"model": "tiny", "max_output_tokens": 12, "temperature": 0}


def session_of(response_id: str) -> str:
    """The session a response id names (docs/responses.md: resp_ + session + tail)."""
    return "ctx_" + response_id[5:37]


def full_text(client: openai.OpenAI, messages: list[dict[str, str]]) -> Response:
    """The same conversation sent whole, stored nowhere and continuing nothing (not an
    implicit session's turn: docs/implicit.md): the reference."""
    return client.responses.create(
        input=messages,  # type: ignore[arg-type]
        instructions=INSTRUCTIONS,
        store=False,
        extra_body={"prompt_cache_options": {"mode": "explicit"}},
        **GREEDY,
    )


def chain(
    client: openai.OpenAI, questions: list[str], previous: str | None = None
) -> list[Response]:
    out: list[Response] = []
    for q in questions:
        r = client.responses.create(
            input=q, instructions=INSTRUCTIONS, previous_response_id=previous, **GREEDY
        )
        out.append(r)
        previous = r.id
    return out


def test_four_turn_chain_equals_the_whole_conversation(stack: Stack, sdk: SDK) -> None:
    client = sdk()
    history: list[dict[str, str]] = []
    previous: str | None = None
    for turn, question in enumerate(QUESTIONS, start=1):
        got = client.responses.create(
            input=question, instructions=INSTRUCTIONS, previous_response_id=previous, **GREEDY
        )
        history.append({"role": "user", "content": question})
        want = full_text(client, history)
        assert got.status in ("completed", "incomplete") and got.object == "response"
        assert got.output_text == want.output_text, f"turn {turn} differs"
        assert got.previous_response_id == previous and got.store is not False
        usage = got.usage
        assert usage is not None and want.usage is not None
        assert usage.input_tokens == want.usage.input_tokens
        assert usage.total_tokens == usage.input_tokens + usage.output_tokens
        if turn > 1:
            cached = usage.input_tokens_details.cached_tokens
            assert cached >= 0.9 * usage.input_tokens, f"turn {turn}: {cached}"
            assert session_of(got.id) == session_of(previous or "")  # appended, not forked
        history.append({"role": "assistant", "content": got.output_text})
        previous = got.id

    assert previous is not None
    back = client.responses.retrieve(previous)
    assert back.output_text == got.output_text and back.usage == got.usage
    items = client.responses.input_items.list(previous, order="asc")
    assert [i.content[0].text for i in items.data] == [QUESTIONS[-1]]  # type: ignore[union-attr]
    with stack.client() as http:  # the chain is one session of the caller's
        info = http.get(f"/v1/context/{session_of(previous)}").json()
    assert info["turns"] == 4 and info["kv_tokens"] > 0


def test_fork_from_an_older_response_leaves_the_chain_as_it_was(stack: Stack, sdk: SDK) -> None:
    client = sdk()
    r1, r2, r3 = chain(client, QUESTIONS[:3])
    before = client.responses.retrieve(r3.id).model_dump()

    fork = client.responses.create(
        input="Something else?", instructions=INSTRUCTIONS, previous_response_id=r2.id, **GREEDY
    )
    assert session_of(fork.id) != session_of(r2.id)  # a new session...
    assert fork.usage is not None and fork.usage.input_tokens_details.cached_tokens >= (
        0.9 * fork.usage.input_tokens
    )  # ...that reuses the prefix's KV
    history = [
        {"role": "user", "content": QUESTIONS[0]},
        {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": QUESTIONS[1]},
        {"role": "assistant", "content": r2.output_text},
        {"role": "user", "content": "Something else?"},
    ]
    assert fork.output_text == full_text(client, history).output_text

    assert client.responses.retrieve(r3.id).model_dump() == before
    # the original chain goes on where it was, in its own session
    r4 = client.responses.create(
        input=QUESTIONS[3], instructions=INSTRUCTIONS, previous_response_id=r3.id, **GREEDY
    )
    assert session_of(r4.id) == session_of(r3.id)
    # and the fork is a chain of its own
    f2 = client.responses.create(input="More?", previous_response_id=fork.id, **GREEDY)
    assert session_of(f2.id) == session_of(fork.id)


def test_fork_reads_its_parents_blocks_from_the_sidecar(stack: Stack, sdk: SDK) -> None:
    """Workers restarted: no L1 anywhere, so the fork's reuse comes from the sidecar, under
    the parent's KV tag."""
    client = sdk()
    r1, _ = chain(client, QUESTIONS[:2])
    stack.restart_workers(list(range(len(stack.workers))))
    deadline = time.time() + 60
    while time.time() < deadline:  # the gateway sees both workers again
        with stack.client() as http:
            if len(http.get("/v1/models").json()["data"]) and http.get("/ready").is_success:
                break
        time.sleep(0.5)
    fork = client.responses.create(
        input="Anything else?", instructions=INSTRUCTIONS, previous_response_id=r1.id, **GREEDY
    )
    usage = fork.usage
    assert usage is not None and session_of(fork.id) != session_of(r1.id)
    assert usage.input_tokens_details.cached_tokens >= 0.9 * usage.input_tokens


def test_streaming_with_the_sdks_event_iterator(stack: Stack, sdk: SDK) -> None:
    client = sdk()
    (first,) = chain(client, QUESTIONS[:1])
    stream = client.responses.create(
        input=QUESTIONS[1],
        instructions=INSTRUCTIONS,
        previous_response_id=first.id,
        stream=True,
        **GREEDY,
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == deltas and final.usage.input_tokens_details.cached_tokens > 0
    # the streamed response was stored, and equals the same turn run without a stream
    assert client.responses.retrieve(final.id).output_text == deltas
    plain = client.responses.create(
        input=QUESTIONS[1], instructions=INSTRUCTIONS, previous_response_id=first.id, **GREEDY
    )
    assert plain.output_text == deltas  # (a fork: the first chain moved on)


def test_conversation_create_three_responses_items_delete(stack: Stack, sdk: SDK) -> None:
    client = sdk()
    conv = client.conversations.create(
        items=[{"type": "message", "role": "system", "content": INSTRUCTIONS}],
        metadata={"topic": "manual"},
    )
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "manual"}
    outputs = []
    history: list[dict[str, str]] = []
    system = {"role": "system", "content": INSTRUCTIONS}
    for turn, q in enumerate(QUESTIONS[:3], start=1):
        r = client.responses.create(input=q, conversation=conv.id, **GREEDY)
        assert r.conversation is not None and r.conversation.id == conv.id
        history += [{"role": "user", "content": q}]
        want = client.responses.create(input=[system, *history], store=False, **GREEDY)  # type: ignore[list-item]
        assert r.output_text == want.output_text, f"turn {turn} differs"
        assert r.usage is not None and want.usage is not None
        assert r.usage.input_tokens == want.usage.input_tokens
        if turn > 1:
            assert r.usage.input_tokens_details.cached_tokens >= 0.9 * r.usage.input_tokens
        history += [{"role": "assistant", "content": r.output_text}]
        outputs.append(r)
    items = client.conversations.items.list(conv.id, order="asc")
    texts = [(i.role, i.content[0].text) for i in items.data]  # type: ignore[union-attr]
    assert texts[0] == ("system", INSTRUCTIONS)
    assert texts[1:] == [(m["role"], m["content"]) for m in history]
    assert [i.id for i in items.data[2::2]] == [r.output[0].id for r in outputs]
    newest = client.conversations.items.list(conv.id, limit=2)
    assert [i.id for i in newest.data] == [i.id for i in items.data[::-1][:2]]
    assert newest.has_more

    updated = client.conversations.update(conv.id, metadata={"topic": "other"})
    assert (
        client.conversations.retrieve(conv.id).metadata == {"topic": "other"} == (updated.metadata)
    )
    deleted = client.conversations.delete(conv.id)
    assert deleted.deleted and deleted.id == conv.id
    with pytest.raises(openai.NotFoundError) as err:
        client.conversations.retrieve(conv.id)
    assert err.value.body["message"] == f"Conversation with id '{conv.id}' not found."  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="hello?", conversation=conv.id, **GREEDY)


def not_found_previous(client: openai.OpenAI, response_id: str) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(input="hi", previous_response_id=response_id, **GREEDY)
    assert err.value.status_code == 400
    return err.value.body  # type: ignore[return-value]


def test_unknown_foreign_expired_and_hostile_ids_answer_like_openai(stack: Stack, sdk: SDK) -> None:
    a, b = sdk("key-a"), sdk("key-b")
    (mine,) = chain(a, QUESTIONS[:1])
    (gone,) = chain(a, QUESTIONS[:1])
    a.responses.delete(gone.id)
    (expiring,) = chain(a, QUESTIONS[:1])
    with stack.client() as http:
        r = http.patch(f"/v1/context/{session_of(expiring.id)}", json={"ttl": 1})
        assert r.status_code == 200, r.text
    time.sleep(2.2)

    hostile = ["resp_x", "resp_" + "A" * 48, "../../etc/passwd", "resp_" + "é" * 48, "x" * 256]
    for rid in [*hostile, gone.id, expiring.id]:
        body = not_found_previous(a, rid)
        assert body == {
            "message": f"Previous response with id '{rid}' not found.",
            "type": "invalid_request_error",
            "param": "previous_response_id",
            "code": "previous_response_not_found",
        }
    # another tenant's real id: the very same answer, nothing about it exists
    assert not_found_previous(b, mine.id)["message"] == (
        f"Previous response with id '{mine.id}' not found."
    )
    for rid in [mine.id, "resp_unknown", gone.id]:
        client = b if rid == mine.id else a
        with pytest.raises(openai.NotFoundError) as err:
            client.responses.retrieve(rid)
        assert err.value.body == {  # type: ignore[comparison-overlap]
            "message": f"Response with id '{rid}' not found.",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
        with pytest.raises(openai.NotFoundError):
            client.responses.delete(rid)
        with pytest.raises(openai.NotFoundError):
            client.responses.input_items.list(rid)
    assert a.responses.retrieve(mine.id).id == mine.id  # still there for its owner
    with pytest.raises(openai.NotFoundError):
        b.conversations.retrieve("conv_" + session_of(mine.id)[4:])  # not a conversation


def test_store_false_leaves_nothing_behind(stack: Stack, sdk: SDK) -> None:
    """`store: false` with implicit sessions off for it (`prompt_cache_options.mode:
    explicit`) writes nothing; by default what it keeps is an implicit session's state, never
    a response (`test_implicit_responses.py`)."""
    client = sdk("key-b")
    off = {"extra_body": {"prompt_cache_options": {"mode": "explicit"}}}
    with stack.client("key-b") as http:
        before = http.get("/v1/context", params={"limit": 100}).json()["data"]
        (parent,) = chain(client, QUESTIONS[:1])
        parent_info = http.get(f"/v1/context/{session_of(parent.id)}").json()
        r = client.responses.create(input="Hi", store=False, **GREEDY, **off)
        cont = client.responses.create(
            input="And?", previous_response_id=parent.id, store=False, **GREEDY
        )
        after = http.get("/v1/context", params={"limit": 100}).json()["data"]
        after_info = http.get(f"/v1/context/{session_of(parent.id)}").json()
    assert r.store is False and cont.store is False and cont.output_text is not None
    for unstored in (r, cont):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(unstored.id)
        body = not_found_previous(client, unstored.id)
        assert body["code"] == "previous_response_not_found"
    # the stored parent only (ids: another test's short-lived sessions of this tenant may
    # expire meanwhile)
    assert {c["session_id"] for c in after} - {c["session_id"] for c in before} == {
        session_of(parent.id)
    }
    assert after_info["turns"] == parent_info["turns"] == 1  # nothing appended to it


def test_deleting_a_chains_responses_deletes_its_session(stack: Stack, sdk: SDK) -> None:
    client = sdk()
    r1, r2 = chain(client, QUESTIONS[:2])
    sid = session_of(r1.id)
    assert client.responses.delete(r1.id) is None  # the SDK returns nothing
    with stack.client() as http:
        assert http.get(f"/v1/context/{sid}").status_code == 200  # r2 is still in it
        assert client.responses.retrieve(r2.id).output_text == r2.output_text
        client.responses.delete(r2.id)
        assert http.get(f"/v1/context/{sid}").status_code == 404


def test_bad_requests_are_clear_400s(stack: Stack, sdk: SDK) -> None:
    client = sdk()
    (r,) = chain(client, QUESTIONS[:1])
    cases: list[tuple[dict[str, Any], str | None]] = [
        ({"previous_response_id": r.id, "conversation": "conv_x"}, "conversation"),
        # the built-in engine has no tool parser: its refusal names the field and the engine
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),  # only function tools
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "o"}]}, None),
        ({"store": "false"}, "store"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ]
    for extra, param in cases:
        body = {"input": "hi", **GREEDY, **extra}
        with httpx.Client(base_url=stack.url, timeout=60) as http:
            got = http.post("/v1/responses", json=body, headers={"authorization": "Bearer key-a"})
        assert got.status_code == 400, (extra, got.text)
        error = got.json()["error"]
        assert error["type"] == "invalid_request_error"
        if param is not None:
            assert error["param"] == param, error
