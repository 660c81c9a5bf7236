"""Conversation items through the openai SDK: add, retrieve, delete; a response after the
edits is the one the edited conversation sent in full gets (greedy), so the dropped token
ids were rendered again exactly; an idempotent add is added once."""

from __future__ import annotations

import uuid
from typing import Any

import openai
import pytest

from tests.gateway.conftest import SDK, Stack


def texts(items: Any) -> list[tuple[str, str]]:
    return [(i.role, i.content[0].text if i.content else "") for i in items]


def test_items_add_retrieve_delete_and_the_next_response_sees_the_edit(
    stack: Stack, sdk: SDK
) -> None:
    client = sdk()
    conv = client.conversations.create(items=[{"role": "user", "content": "Alpha."}])
    first = client.responses.create(
        model="tiny", conversation=conv.id, input="Beta?", max_output_tokens=4, temperature=0
    )
    added = client.conversations.items.create(
        conv.id,
        items=[
            {"type": "message", "role": "user", "content": "Gamma."},
            {"type": "message", "role": "assistant", "content": "Delta."},
        ],
    )
    assert texts(added.data) == [("user", "Gamma."), ("assistant", "Delta.")]
    listed = client.conversations.items.list(conv.id, order="asc")
    assert texts(listed.data) == [
        ("user", "Alpha."),
        ("user", "Beta?"),
        ("assistant", first.output_text),
        ("user", "Gamma."),
        ("assistant", "Delta."),
    ]
    assert [i.id for i in listed.data][-2:] == [i.id for i in added.data]
    got = client.conversations.items.retrieve(added.data[0].id, conversation_id=conv.id)
    assert got.id == added.data[0].id and texts([got]) == [("user", "Gamma.")]

    # delete "Beta?": the items after it move up
    gone = client.conversations.items.delete(listed.data[1].id, conversation_id=conv.id)
    assert gone.id == conv.id and gone.object == "conversation"
    after = client.conversations.items.list(conv.id, order="asc")
    edited = [
        ("user", "Alpha."),
        ("assistant", first.output_text),
        ("user", "Gamma."),
        ("assistant", "Delta."),
    ]
    assert texts(after.data) == edited
    with pytest.raises(openai.NotFoundError) as missing:
        client.conversations.items.retrieve("msg_" + "0" * 40, conversation_id=conv.id)
    assert missing.value.type == "invalid_request_error"  # type: ignore[attr-defined]

    # the next response continues the edited conversation exactly as if sent in full
    turn = client.responses.create(
        model="tiny", conversation=conv.id, input="Epsilon?", max_output_tokens=6, temperature=0
    )
    full = client.responses.create(
        model="tiny",
        input=[{"role": r, "content": t} for r, t in [*edited, ("user", "Epsilon?")]],
        max_output_tokens=6,
        temperature=0,
        store=False,
    )
    assert turn.output_text == full.output_text
    assert turn.usage is not None and full.usage is not None
    assert turn.usage.input_tokens == full.usage.input_tokens


def test_an_idempotent_add_is_added_once_and_items_of_others_are_not_found(
    stack: Stack,
    sdk: SDK,
) -> None:
    client = sdk()
    conv = client.conversations.create()
    key = {"Idempotency-Key": f"items-{uuid.uuid4()}"}
    items = [{"type": "message", "role": "user", "content": "Once."}]
    a = client.conversations.items.create(conv.id, items=items, extra_headers=key)  # type: ignore[arg-type]
    b = client.conversations.items.create(conv.id, items=items, extra_headers=key)  # type: ignore[arg-type]
    assert a.data[0].id == b.data[0].id
    assert len(client.conversations.items.list(conv.id).data) == 1
    with pytest.raises(openai.ConflictError) as reused:
        client.conversations.items.create(
            conv.id,
            items=[{"type": "message", "role": "user", "content": "Twice."}],
            extra_headers=key,
        )
    assert reused.value.code == "idempotency_key_reused"  # type: ignore[attr-defined]
    other = sdk("key-b")
    with pytest.raises(openai.NotFoundError):
        other.conversations.items.create(conv.id, items=items)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        other.conversations.items.delete(a.data[0].id, conversation_id=conv.id)
    with pytest.raises(openai.BadRequestError):
        client.conversations.items.create(conv.id, items=[])
