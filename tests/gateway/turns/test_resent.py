"""Which of a turn's messages the session already holds (`gateway.resent`): clients' echoes
of the gateway's own answers match what the session stored (the openai SDK's and
LangChain's, made by the installed packages from the answer the gateway sent)."""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_openai.chat_models.base import _convert_dict_to_message, _convert_message_to_dict
from openai.types.chat import ChatCompletionMessage

from gateway.resent import canonical, held
from gateway.tools import assistant_message

# the engine's message, as vLLM's chat endpoint answers a tool call (and the gateway passes
# on): what a client reads back
ENGINE_CALL = {
    "role": "assistant",
    "content": None,
    "refusal": None,
    "annotations": None,
    "audio": None,
    "function_call": None,
    "tool_calls": [
        {
            "id": "chatcmpl-tool-1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":2}'},
        }
    ],
    "reasoning_content": None,
}
ENGINE_TEXT = {"role": "assistant", "content": "It is sunny.", "refusal": None, "tool_calls": []}
SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "Weather in Paris?"}
TOOL = {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "sunny"}


def sdk_echoes(engine: dict[str, Any]) -> list[dict[str, Any]]:
    message = ChatCompletionMessage.model_validate(engine)
    return [message.to_dict(), message.model_dump(exclude_none=True), message.model_dump()]


def langchain_echo(engine: dict[str, Any]) -> dict[str, Any]:
    return _convert_message_to_dict(_convert_dict_to_message(engine))


@pytest.mark.parametrize("engine", [ENGINE_CALL, ENGINE_TEXT, {**ENGINE_CALL, "content": ""}])
def test_clients_echoes_of_an_answer_match_what_the_session_stored(engine: dict[str, Any]) -> None:
    stored = assistant_message(engine)  # what `Generation.assistant()` keeps
    for echo in [*sdk_echoes(engine), langchain_echo(engine)]:
        assert canonical(echo) == canonical(stored), echo


def test_langchain_reserializes_arguments_and_still_matches() -> None:
    echo = langchain_echo(ENGINE_CALL)
    assert echo["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "days": 2}'
    assert canonical(echo) == canonical(assistant_message(ENGINE_CALL))


def test_a_whole_langchain_history_is_held() -> None:
    history = [SYSTEM, USER, assistant_message(ENGINE_CALL), TOOL, assistant_message(ENGINE_TEXT)]
    sent = [
        _convert_message_to_dict(m)
        for m in [
            SystemMessage("Be brief."),
            HumanMessage("Weather in Paris?"),
            _convert_dict_to_message(ENGINE_CALL),
            ToolMessage("sunny", tool_call_id="chatcmpl-tool-1"),
            _convert_dict_to_message(ENGINE_TEXT),
            HumanMessage("And tomorrow?"),
        ]
    ]
    assert held(history, sent) == 5


def test_content_forms() -> None:
    as_parts = {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}
    assert canonical(as_parts) == canonical(USER)
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    two = {"role": "user", "content": parts}
    assert canonical(two) != canonical({"role": "user", "content": "ab"})
    assert canonical({"role": "assistant", "content": ""}) == canonical(
        {"role": "assistant", "content": None}
    )
    assert canonical({**USER, "name": "ann"}) != canonical(USER)
    assert canonical({**USER, "content": "weather in Paris?"}) != canonical(USER)


def test_what_differs_in_a_call_is_seen() -> None:
    stored = assistant_message(ENGINE_CALL)
    for change in [
        {"id": "other"},
        {"function": {"name": "get_time", "arguments": '{"city":"Paris","days":2}'}},
        {"function": {"name": "get_weather", "arguments": '{"city":"Rome","days":2}'}},
    ]:
        call = {**ENGINE_CALL["tool_calls"][0], **change}
        assert canonical({**ENGINE_CALL, "tool_calls": [call]}) != canonical(stored), change
    not_json = {**ENGINE_CALL["tool_calls"][0], "function": {"name": "f", "arguments": "{x"}}
    assert canonical({**ENGINE_CALL, "tool_calls": [not_json]}) == canonical(
        {**ENGINE_CALL, "tool_calls": [dict(not_json)]}
    )


def test_held_needs_the_whole_history_at_the_start() -> None:
    history = [SYSTEM, USER, assistant_message(ENGINE_TEXT)]
    new = {"role": "user", "content": "Thanks."}
    assert held(history, [*history, new]) == 3
    assert held(history, list(history)) == 3  # all of it: nothing new
    assert held(history, [new]) == 0  # only what is new: as always
    assert held(history, [SYSTEM, USER, new]) == 0  # a part of it, then other messages
    assert held(history, history[:2]) == 0  # shorter than the history
    assert held([], [new]) == 0
    edited = [SYSTEM, {"role": "user", "content": "Weather in Rome?"}, history[2], new]
    assert held(history, edited) == 0


def test_deeply_nested_content_is_never_held() -> None:
    """A hostile part nested past any template's use: compared without recursing into it,
    and equal to nothing (so the turn's messages are new, as before)."""
    deep: Any = "x"
    for _ in range(5000):
        deep = {"a": deep}
    message = {"role": "user", "content": [{"type": "text", "text": "a"}, deep]}
    assert canonical(message) != canonical(message)
    assert held([message], [message, USER]) == 0
    arguments = "[" * 600 + "]" * 600  # (JSON orjson reads but will not write back)
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    sent = {"role": "assistant", "content": None, "tool_calls": [call]}
    assert canonical(sent) == canonical(dict(sent))
