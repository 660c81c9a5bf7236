"""A session turn that resends the session's own history (docs/agents.md, "A turn that
resends the history"): agent frameworks (LangGraph, pydantic-ai) send the whole
conversation on every step, also when a user adds `session_id`. The part of a turn's
messages that the session already holds is not new.

Messages are compared in a canonical form (`canonical`), so that a client's echo of the
gateway's own answers matches what the session stored, whichever fields the client adds or
drops and however it re-serializes tool-call arguments.
"""

from __future__ import annotations

from typing import Any

import orjson

Messages = list[dict[str, Any]]


def canonical(message: dict[str, Any]) -> tuple[Any, ...]:
    """What of a message the comparison sees: its role, content, tool calls (id, name,
    arguments), `tool_call_id` and `name`. Any other field (`refusal: null`,
    `annotations: []`, `audio: null`, `function_call: null`, ...) is not compared.

    - content: absent, None, "" and [] are alike; a list of one text part equals its text;
      other parts are compared as they are, without their None fields;
    - a tool call's arguments are compared as the JSON value they hold (spacing and key
      order aside), or as the string if it is not JSON; its `type` defaults to function.
    """
    return (
        message.get("role"),
        _content(message.get("content")),
        _calls(message.get("tool_calls")),
        message.get("tool_call_id") or None,
        message.get("name") or None,
    )


def _content(content: Any) -> Any:
    if not content:
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if len(content) == 1 and isinstance(content[0], dict):
            part = content[0]
            if part.get("type") == "text" and isinstance(part.get("text"), str):
                return part["text"] or None
        return tuple(_frozen(p) for p in content)
    return _frozen(content)


def _calls(calls: Any) -> Any:
    if not calls:
        return None
    if not isinstance(calls, list):
        return _frozen(calls)
    out = []
    for call in calls:
        if not isinstance(call, dict):
            out.append(_frozen(call))
            continue
        fn = call.get("function") if isinstance(call.get("function"), dict) else {}
        out.append(
            (
                call.get("id"),
                call.get("type") or "function",
                fn.get("name"),
                _arguments(fn.get("arguments")),
            )
        )
    return tuple(out)


def _arguments(arguments: Any) -> Any:
    if not arguments:
        return None
    value = arguments
    if isinstance(arguments, str):
        try:
            value = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return ("text", arguments)
    try:
        return ("json", orjson.dumps(value, option=orjson.OPT_SORT_KEYS))
    except (orjson.JSONEncodeError, TypeError):  # (nested past orjson's limit, say)
        return ("text", arguments if isinstance(arguments, str) else object())


MAX_DEPTH = 32  # a part nested deeper than this equals nothing (its turn's messages are new)


def _frozen(value: Any, depth: int = 0) -> Any:
    """A JSON value as something comparable (None fields of objects left out)."""
    if depth > MAX_DEPTH:
        return object()  # (equal to nothing else: no recursion into hostile nesting)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v, depth + 1)) for k, v in value.items() if v is not None))
    if isinstance(value, list):
        return tuple(_frozen(v, depth + 1) for v in value)
    return value


def held(history: Messages, messages: Messages) -> int:
    """How many of a turn's `messages` the session already holds: all of `history` when
    the messages begin with the whole of it (message by message, `canonical`), else 0 (a
    turn that shares only part of the history sends new messages, as it always did)."""
    n = len(history)
    if not n or len(messages) < n:
        return 0
    for stored, sent in zip(history, messages, strict=False):
        if not isinstance(sent, dict) or canonical(stored) != canonical(sent):
            return 0
    return n
