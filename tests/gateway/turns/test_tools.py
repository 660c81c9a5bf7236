"""The agent-field checks a session turn runs before anything is generated (gateway/tools.py);
end to end on the real vLLM: tests/vllm_connector/test_agents_vllm.py."""

from __future__ import annotations

from typing import Any

import pytest

from ctxcache.errors import InvalidRequest
from gateway.tools import (
    StreamedCalls,
    assistant_message,
    check_agent_fields,
    check_tool_messages,
    check_tools,
    same_tools,
    uses_chat_engine,
)

TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
}
CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
}


class refused:  # (a context manager: `with refused(param):`)
    """The block raises `InvalidRequest` naming `param`."""

    def __init__(self, param: str) -> None:
        self.param = param

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        assert isinstance(exc, InvalidRequest), f"not refused: {exc!r}"
        assert exc.param == self.param, (exc.param, exc.message)
        return True


@pytest.mark.parametrize(
    "tools, param",
    [
        ({"type": "function"}, "tools"),
        ([{"type": "web_search"}], "tools[0]"),
        ([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
        ([TOOL, TOOL], "tools[1].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": 3}}],
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}],
            "tools[0].function.parameters",
        ),
    ],
)
def test_tools_that_are_not_function_tools_with_a_schema_are_refused(
    tools: Any, param: str
) -> None:
    with refused(param):
        check_tools(tools)


def test_good_tools_pass() -> None:
    assert check_tools([TOOL]) == [TOOL]
    assert check_tools(None) is None


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": 1}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"functions": [{}]}, "functions"),
    ],
)
def test_a_choice_or_format_the_tools_cannot_meet_is_refused(
    body: dict[str, Any], param: str
) -> None:
    with refused(param):
        check_agent_fields(body, [TOOL])


def test_required_needs_tools() -> None:
    with refused("tool_choice"):
        check_agent_fields({"tool_choice": "required"}, None)
    check_agent_fields({"tool_choice": "required"}, [TOOL])
    check_agent_fields({"tool_choice": {"type": "function", "function": {"name": "f"}}}, [TOOL])


def test_tool_messages_answer_a_call_of_the_message_before_them() -> None:
    answer = [{"role": "tool", "tool_call_id": "c1", "content": "x"}]
    check_tool_messages([{"role": "user", "content": "q"}, CALLED], answer)
    check_tool_messages([], [{"role": "user", "content": "q"}, CALLED, *answer, *answer])
    with refused("messages[0].tool_call_id"):
        check_tool_messages([CALLED], [{"role": "tool", "tool_call_id": "c9", "content": "x"}])
    with refused("messages[0]"):
        check_tool_messages([{"role": "assistant", "content": "hi"}], answer)
    with refused("messages[1]"):
        check_tool_messages([CALLED], [{"role": "user", "content": "q"}, *answer])


def test_same_tools_ignores_key_order_not_list_order() -> None:
    other = {"type": "function", "function": {"name": "g"}}
    flipped = {
        "function": {"parameters": TOOL["function"]["parameters"], "name": "f"},
        "type": "function",
    }
    assert same_tools([TOOL], [flipped])
    assert not same_tools([TOOL, other], [other, TOOL])
    assert same_tools(None, []) and not same_tools(None, [TOOL])


def test_which_turns_need_the_chat_endpoint() -> None:
    assert uses_chat_engine({}, [TOOL])
    assert uses_chat_engine({"logprobs": True}, None)
    assert uses_chat_engine({"response_format": {"type": "json_object"}}, None)
    assert not uses_chat_engine({"parallel_tool_calls": True, "tool_choice": "none"}, None)
    assert not uses_chat_engine({"response_format": {"type": "text"}, "logprobs": False}, None)


def test_streamed_calls_are_put_together_by_index() -> None:
    calls = StreamedCalls()
    calls.add([{"index": 0, "id": "a", "function": {"name": "f", "arguments": '{"x"'}}])
    calls.add([{"index": 1, "id": "b", "function": {"name": "g", "arguments": ""}}])
    calls.add([{"index": 0, "function": {"arguments": ": 1}"}}])
    got = calls.list()
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in got] == [
        ("a", "f", '{"x": 1}'),
        ("b", "g", ""),
    ]
    kept = assistant_message({"role": "assistant", "content": None, "tool_calls": got, "x": 1})
    assert kept == {"role": "assistant", "content": None, "tool_calls": got}
