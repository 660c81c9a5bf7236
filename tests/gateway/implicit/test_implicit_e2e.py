"""Implicit sessions on the real stack (docs/implicit.md): a client that resends the whole
conversation without `session_id` gets its history's KV reused, answers the same as an
explicit session, and never reuses another tenant's conversation."""

from __future__ import annotations

import itertools
import re
from typing import Any

import httpx
import openai
import orjson

from tests.gateway.conftest import SDK, Stack

FACTS = " ".join(f"Fact {i}: an implicit session keeps turn {i}." for i in range(16))
QUESTIONS = ["What is kept?", "Where is it kept?", "For how long?"]


def system(tag: str) -> dict[str, Any]:
    # a tag per test: conversations of different tests never share a prefix
    return {"role": "system", "content": f"[{tag}] You answer briefly. {FACTS}"}


def ask(client: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        **kw,
    )


def implicit_counts(stack: Stack) -> dict[str, float]:
    text = httpx.get(f"{stack.url}/metrics", timeout=30).text
    found = re.findall(r'^ctxcache_gateway_implicit_total\{result="(\w+)"\} (\S+)$', text, re.M)
    return {result: float(value) for result, value in found}


def cached(answer: Any) -> int:
    details = answer.usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else 0


def converse(client: openai.OpenAI, tag: str, **kw: Any) -> list[Any]:
    """Three user turns, each sending the whole conversation so far (the SDK's echo of
    each answer appended, as a chat loop over the SDK does)."""
    history: list[dict[str, Any]] = [system(tag)]
    answers = []
    for question in QUESTIONS:
        history.append({"role": "user", "content": question})
        answer = ask(client, history, **kw)
        answers.append(answer)
        history.append(answer.choices[0].message.model_dump(exclude_none=True))
    return answers


def test_a_resent_conversation_reuses_its_history(stack: Stack, sdk: SDK) -> None:
    before = implicit_counts(stack)
    answers = converse(sdk(), "reuse")
    after = implicit_counts(stack)
    assert after["miss"] - before["miss"] == 1
    assert after["hit"] - before["hit"] == 2
    for previous, answer in itertools.pairwise(answers):
        # all but the last partial block of the previous prompt and its answer is reused
        assert cached(answer) >= previous.usage.prompt_tokens - 64, (cached(answer), previous)
    raw = answers[-1].model_dump()
    assert "session_id" not in raw and "session" not in raw  # what a client gets without us


def test_an_implicit_turn_answers_what_an_explicit_session_does(stack: Stack, sdk: SDK) -> None:
    client = sdk()
    implicit = converse(client, "same")
    with stack.client() as http:
        first = [system("same"), {"role": "user", "content": QUESTIONS[0]}]
        made = http.post(
            "/v1/context",
            json={"model": "tiny", "messages": first, "max_tokens": 8, "temperature": 0},
        ).json()
    explicit = [made["choices"][0]["message"]["content"]]
    for question in QUESTIONS[1:]:
        turn = ask(
            client,
            [{"role": "user", "content": question}],
            extra_body={"session_id": made["session_id"]},
        )
        explicit.append(turn.choices[0].message.content)
    assert [a.choices[0].message.content for a in implicit] == explicit
    assert implicit[-1].usage.prompt_tokens == turn.usage.prompt_tokens


def test_another_tenant_reuses_nothing_of_the_same_conversation(stack: Stack, sdk: SDK) -> None:
    converse(sdk("key-a"), "tenants")
    before = implicit_counts(stack)
    answers = converse(sdk("key-b"), "tenants")
    after = implicit_counts(stack)
    assert after["miss"] - before["miss"] == 1  # tenant-b's first turn found nothing
    assert cached(answers[0]) < 16  # (nothing but what tenant-b itself sent before)


def test_a_regenerated_answer_branches_and_leaves_the_conversation(stack: Stack, sdk: SDK) -> None:
    client = sdk()
    history: list[dict[str, Any]] = [system("branch"), {"role": "user", "content": QUESTIONS[0]}]
    first = ask(client, history)
    history.append(first.choices[0].message.model_dump(exclude_none=True))
    history.append({"role": "user", "content": QUESTIONS[1]})
    second = ask(client, history)  # a hit: the conversation moves on to its third state
    before = implicit_counts(stack)
    again = ask(client, history)  # the same request again: a branch of the second state
    after = implicit_counts(stack)
    assert after["branch"] - before["branch"] == 1
    assert again.choices[0].message.content == second.choices[0].message.content
    assert cached(again) >= first.usage.prompt_tokens - 64
    # the original conversation is intact: its next turn still continues it
    history.append(second.choices[0].message.model_dump(exclude_none=True))
    history.append({"role": "user", "content": QUESTIONS[2]})
    before = implicit_counts(stack)
    ask(client, history)
    assert implicit_counts(stack)["hit"] - before["hit"] == 1


def test_an_edited_message_reuses_only_what_precedes_it(stack: Stack, sdk: SDK) -> None:
    client = sdk()
    answers = converse(client, "edited")
    history: list[dict[str, Any]] = [
        system("edited"),
        {"role": "user", "content": "Something else entirely?"},  # (was QUESTIONS[0])
        answers[0].choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": QUESTIONS[1]},
    ]
    before = implicit_counts(stack)
    edited = ask(client, history)
    after = implicit_counts(stack)
    # the system prompt before the edit is shared (a fork of its prefix), nothing after it
    assert after["shared"] - before["shared"] == 1
    assert (after["hit"], after["branch"]) == (before["hit"], before["branch"])
    assert cached(edited) <= answers[0].usage.prompt_tokens - 8


def test_a_streamed_conversation_is_an_implicit_session_too(stack: Stack, sdk: SDK) -> None:
    client = sdk()
    history: list[dict[str, Any]] = [system("stream")]
    usages = []
    for question in QUESTIONS[:2]:
        history.append({"role": "user", "content": question})
        chunks = list(
            client.chat.completions.create(
                model="tiny",
                messages=history,  # type: ignore[arg-type]
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert usage is not None and "session_id" not in chunks[-1].model_dump()
        usages.append(usage)
        history.append({"role": "assistant", "content": text})
    assert usages[1].prompt_tokens_details.cached_tokens >= usages[0].prompt_tokens - 64


def test_prompt_cache_key_is_part_of_the_match(stack: Stack, sdk: SDK) -> None:
    client = sdk()
    history: list[dict[str, Any]] = [system("key"), {"role": "user", "content": QUESTIONS[0]}]
    first = ask(client, history, extra_body={"prompt_cache_key": "user-1"})
    history += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "user", "content": QUESTIONS[1]},
    ]
    before = implicit_counts(stack)
    ask(client, history, extra_body={"prompt_cache_key": "user-2"})  # another key: a miss
    ask(client, history, extra_body={"prompt_cache_key": "user-1", "prompt_cache_retention": "24h"})
    after = implicit_counts(stack)
    assert (after["miss"] - before["miss"], after["hit"] - before["hit"]) == (1, 1)


def test_prompt_cache_options_explicit_mode_passes_through(stack: Stack, sdk: SDK) -> None:
    before = implicit_counts(stack)
    ask(
        sdk(),
        [system("explicit"), {"role": "user", "content": "Hi?"}],
        extra_body={"prompt_cache_options": {"mode": "explicit", "ttl": "30m"}},
    )
    assert implicit_counts(stack)["passed"] - before["passed"] == 1


def prompt_tokens_by_worker(stack: Stack) -> list[float]:
    out = []
    for worker in stack.workers:
        text = httpx.get(f"{worker.url}/metrics", timeout=30).text
        found = re.search(r"^ctxcache_worker_prompt_tokens_total (\S+)$", text, re.M)
        out.append(float(found[1]) if found else 0.0)
    return out


def test_new_conversations_with_one_prompt_cache_key_go_to_one_worker(
    stack: Stack, sdk: SDK
) -> None:
    """Requests of the same key go to the worker the key hashes to (the two workers are
    idle: within the load bound), so a shared prefix of theirs is hot there."""
    client = sdk()
    before = prompt_tokens_by_worker(stack)
    for i in range(4):
        messages = [system("routed"), {"role": "user", "content": f"Question {i}?"}]
        ask(client, messages, extra_body={"prompt_cache_key": "one-user"})
    after = prompt_tokens_by_worker(stack)
    grew = [b - a for a, b in zip(before, after, strict=True)]
    assert sorted(g > 0 for g in grew) == [False, True], grew  # one worker ran all four


def test_a_new_conversation_forks_another_ones_system_prompt(stack: Stack, sdk: SDK) -> None:
    """The system prompt of a conversation is kept as a shared prefix: a new conversation
    of the same tenant with the same system prompt forks it (its KV read by the first
    conversation's tag), and answers what it answers alone."""
    client = sdk()
    first = ask(client, [system("prefix"), {"role": "user", "content": QUESTIONS[0]}])
    before = implicit_counts(stack)
    other = [system("prefix"), {"role": "user", "content": "Something else?"}]
    second = ask(client, other)
    after = implicit_counts(stack)
    assert after["shared"] - before["shared"] == 1 and after["miss"] == before["miss"]
    assert cached(second) >= first.usage.prompt_tokens - 64 - 16  # (the system prompt's)
    alone = ask(sdk("key-b"), other)  # the same question where nothing is shared
    assert alone.choices[0].message.content == second.choices[0].message.content
    # and the new conversation is one of its own: its next turn continues it
    before = implicit_counts(stack)
    ask(
        client,
        [
            *other,
            second.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "More?"},
        ],
    )
    assert implicit_counts(stack)["hit"] - before["hit"] == 1


def test_a_breakpoint_shares_the_prefix_up_to_it(stack: Stack, sdk: SDK) -> None:
    client = sdk()
    document = {
        "role": "user",
        "content": [
            {"type": "text", "text": "[breakpoint] Read this. " + FACTS},
            {"type": "text", "text": " End.", "prompt_cache_breakpoint": {"mode": "explicit"}},
        ],
    }
    head = [{"role": "system", "content": "Be brief."}, document]
    ask(client, [*head, {"role": "user", "content": QUESTIONS[0]}])
    before = implicit_counts(stack)
    ask(client, [*head, {"role": "user", "content": QUESTIONS[1]}])
    assert implicit_counts(stack)["shared"] - before["shared"] == 1


def shape_of(value: Any) -> Any:
    """The fields of an answer, nested (the values aside)."""
    if isinstance(value, dict):
        return {k: shape_of(v) for k, v in value.items() if k not in ("logprobs",)}
    if isinstance(value, list):
        return [shape_of(v) for v in value[:1]]
    return type(value).__name__ if value is not None else None


def fields_of(value: Any) -> set[str]:
    """Every field path of an answer that holds a value (the engine's nulls aside)."""
    out: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            if v is not None:
                out |= {k} | {f"{k}.{f}" for f in fields_of(v)}
    elif isinstance(value, list) and value:
        out |= {f"[].{f}" for f in fields_of(value[0])}
    return out


def test_an_implicit_answer_has_the_fields_a_pass_through_has(stack: Stack) -> None:
    """A miss's answer is the engine's own (its ids nulled), field for field; a hit's,
    shaped by the gateway, has every field with a value that the pass-through's has (the
    engine's extension fields that are null, `prompt_token_ids`, `kv_transfer_params`,
    `stop_reason`, are not written: docs/implicit.md), streamed or not."""
    plain = {"prompt_cache_options": {"mode": "explicit"}}
    with stack.client() as http:
        history: list[dict[str, Any]] = [system("shape"), {"role": "user", "content": "One?"}]
        body = {"model": "tiny", "messages": history, "max_tokens": 4, "temperature": 0}
        miss = http.post("/v1/chat/completions", json=body).json()
        passed = http.post("/v1/chat/completions", json={**body, **plain}).json()
        assert shape_of(miss) == shape_of(passed)
        history += [miss["choices"][0]["message"], {"role": "user", "content": "Two?"}]
        hit = http.post("/v1/chat/completions", json=body).json()
        passed = http.post("/v1/chat/completions", json={**body, **plain}).json()
        assert fields_of(hit) == fields_of(passed)

        def chunks(extra: dict[str, Any]) -> list[set[str]]:
            doc = {**body, "stream": True, "stream_options": {"include_usage": True}, **extra}
            r = http.post("/v1/chat/completions", json=doc)
            events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
            assert events[-1] == "[DONE]"
            return [fields_of(orjson.loads(e)) for e in events[:-1]]

        history += [hit["choices"][0]["message"], {"role": "user", "content": "Three?"}]
        streamed_hit = chunks({})
        streamed_passed = chunks(plain)
    assert streamed_hit[0] == streamed_passed[0] and streamed_hit[-1] == streamed_passed[-1]
