"""The Responses API without `previous_response_id`: a whole `input` that resends a
conversation continues it as an implicit session (docs/implicit.md), stored or not."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from gateway.responses.protocol import parse_response_id
from tests.gateway.conftest import SDK, Stack
from tests.gateway.implicit.test_implicit_e2e import FACTS, implicit_counts


def session_of(response_id: str) -> str:
    parsed = parse_response_id(response_id)
    assert parsed is not None
    return parsed[0]


def create(client: openai.OpenAI, items: list[dict[str, Any]], store: bool, **kw: Any) -> Any:
    kw.setdefault("instructions", f"You answer briefly. {FACTS}")
    return client.responses.create(
        model="tiny",
        input=items,  # type: ignore[arg-type]
        max_output_tokens=8,
        temperature=0,
        store=store,
        **kw,
    )


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def said(response: Any) -> dict[str, Any]:
    text = response.output_text
    return {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text}],
    }


@pytest.mark.parametrize("store", [True, False])
def test_a_whole_input_continues_the_conversation_it_resends(
    stack: Stack, sdk: SDK, store: bool
) -> None:
    client = sdk()
    tag = f"[responses-{store}] "
    first = create(client, [user(tag + "What is kept?")], store)
    items = [user(tag + "What is kept?"), said(first), user("Where?")]
    second = create(client, items, store)
    assert session_of(second.id) == session_of(first.id)  # the same conversation, appended
    third = create(client, [*items, said(second), user("How long?")], store)
    assert session_of(third.id) == session_of(first.id)
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens - 64
    if store:  # the same answer as continuing by id (a fork of the first response now)
        by_id = client.responses.create(
            model="tiny",
            instructions=f"You answer briefly. {FACTS}",
            input="Where?",
            previous_response_id=first.id,
            max_output_tokens=8,
            temperature=0,
        )
        assert by_id.output_text == second.output_text


def test_a_whole_input_of_another_tenant_is_its_own(stack: Stack, sdk: SDK) -> None:
    a, b = sdk("key-a"), sdk("key-b")
    first = create(a, [user("[tenants] What is kept?")], True)
    items = [user("[tenants] What is kept?"), said(first), user("Where?")]
    other = create(b, items, True)
    assert session_of(other.id) != session_of(first.id)


def test_whole_inputs_are_counted_and_share_their_instructions(stack: Stack, sdk: SDK) -> None:
    """Responses' whole inputs count in `ctxcache_gateway_implicit_total` as chat requests
    do, and a new chain's instructions (a system prompt) are a shared prefix: another new
    chain with the same instructions forks them, and answers what it answers alone."""
    client = sdk()
    shared = {"instructions": f"[responses-shared] You answer briefly. {FACTS}"}
    before = {k: 0.0 for k in ("miss", "hit", "shared")} | implicit_counts(stack)
    first = create(client, [user("What is kept?")], True, **shared)
    items = [user("What is kept?"), said(first), user("Where?")]
    create(client, items, False, **shared)
    mid = implicit_counts(stack)
    assert mid["miss"] - before["miss"] == 1 and mid["hit"] - before["hit"] == 1
    other = create(client, [user("Something else?")], True, **shared)
    after = implicit_counts(stack)
    assert after["shared"] - mid["shared"] == 1 and after["miss"] == mid["miss"]
    assert other.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 64 - 16
    alone = create(sdk("key-b"), [user("Something else?")], True, **shared)
    assert alone.output_text == other.output_text
