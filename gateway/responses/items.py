"""Responses items and tools <-> the chat messages and tools a session keeps.

A session's history is chat messages (what the chat template renders): a `function_call`
item is a call of an assistant message's `tool_calls`, a `function_call_output` item a
`tool` message. Responses' function tools are chat tools without the `function` wrapper.
"""

from __future__ import annotations

from typing import Any, TypeGuard

from ctxcache.errors import InvalidRequest

Message = dict[str, Any]


def call_item_id(message_item_id: str, k: int) -> str:
    """The id of the `k`-th function call of the message whose item id is given (it names
    that message: `message_of_call` gives it back)."""
    return f"fc_{message_item_id.removeprefix('msg_')}_{k}"


def message_of_call(call_id: str) -> str:
    return "msg_" + call_id.removeprefix("fc_").rsplit("_", 1)[0]


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools as chat tools; any other kind of tool is refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise InvalidRequest(
                f"only function tools are supported (not {kind!r})", param=f"tools[{i}]"
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """Responses' `{"type": "function", "name"}` as chat's named choice, and its
    `{"type": "allowed_tools", "mode", "tools": [{"type": "function", "name"}, ...]}` as
    chat's `allowed_tools` (the chat checks then say what is wrong with either)."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        if "allowed_tools" in choice:  # (chat's form already)
            return choice
        tools = choice.get("tools")
        if isinstance(tools, list):
            tools = [
                {"type": "function", "function": {"name": t.get("name")}}
                if isinstance(t, dict) and t.get("type") == "function" and "function" not in t
                else t
                for t in tools
            ]
        return {
            "type": "allowed_tools",
            "allowed_tools": {"mode": choice.get("mode"), "tools": tools},
        }
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (None: plain text)."""
    fmt = (text or {}).get("format") or {}
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise InvalidRequest(
        "text.format type must be text, json_object or json_schema", param="text.format"
    )


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or "" for p in content or () if isinstance(p, dict))


def messages_of(items: list[dict[str, Any]]) -> list[Message]:
    """Input items as chat messages: function calls join the assistant message before them
    (parallel calls are one message), outputs are tool messages."""
    out: list[Message] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        last = out[-1] if out else None
        if kind == "reasoning":  # (checked against the output it was: `responses.reasoning`)
            text = "".join(p.get("text") or "" for p in item.get("content") or ())
            out.append({"role": "assistant", "content": None, "reasoning": text})
        elif kind == "message" and item["role"] == "assistant" and _reasoning_only(last):
            last["content"] = _text(item.get("content"))
        elif kind == "message":
            out.append({"role": item["role"], "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments") or ""},
            }
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant" and not last.get("content"):
                last["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            content = _text(item.get("output"))
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        else:
            raise InvalidRequest(
                f"input items of type {kind!r} are not supported", param=f"input[{i}]"
            )
    return out


def _reasoning_only(message: Message | None) -> TypeGuard[Message]:
    """An assistant message made of a reasoning item alone, so far (its answer follows)."""
    return (
        message is not None
        and "reasoning" in message
        and not message.get("content")
        and not message.get("tool_calls")
    )


def message_item(item_id: str, role: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A message item as OpenAI lists it (input items, conversation items, output)."""
    if role == "assistant":
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    else:
        part = {"type": "input_text", "text": text}
    return {
        "id": item_id,
        "type": "message",
        "role": role,
        "status": status,
        "content": [part] if text or role != "assistant" else [],
    }


def call_item(item_id: str, call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call.get("function") or {}
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call.get("id"),
        "name": fn.get("name"),
        "arguments": fn.get("arguments") or "",
        "status": status,
    }


def items_of(message: Message, item_id: str, status: str = "completed") -> list[dict[str, Any]]:
    """The items a stored message lists as: a message (with its text, if any, or with no
    calls), its function calls, or a function call's output."""
    role = message["role"]
    if role == "tool":
        return [
            {
                "id": item_id,
                "type": "function_call_output",
                "call_id": message.get("tool_call_id"),
                "output": message.get("content") or "",
                "status": "completed",
            }
        ]
    text = message.get("content") or ""
    calls = message.get("tool_calls") or []
    out = [message_item(item_id, role, text, status)] if text or not calls else []
    out += [call_item(call_item_id(item_id, k), c, status) for k, c in enumerate(calls)]
    return out
