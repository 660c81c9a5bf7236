"""Agent fields of a session turn: tools, tool choice, tool messages (docs/agents.md).

What the model writes is parsed by the engine (vLLM's `--tool-call-parser`), and a forced
choice is enforced there too (structured outputs): nothing here knows a model family. This
module checks what a client sends against the session before anything runs, so that a
refused turn changes nothing, and keeps what the history needs of an answer.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
from jsonschema import exceptions as schema_errors
from jsonschema import validators

from ctxcache.errors import InvalidRequest

# Fields that only the engine's chat endpoint honours (a turn that carries any of them is
# sent there, with the prompt as token ids: `gateway.turn_engine`).
AGENT_FIELDS = (
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "logprobs",
    "top_logprobs",
)
# OpenAI's deprecated form of tools: refused with a pointer to `tools`.
LEGACY_FIELDS = ("functions", "function_call")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CHOICES = ("none", "auto", "required")
ALLOWED_MODES = ("auto", "required")  # an `allowed_tools` choice's

Tools = list[dict[str, Any]]


def check_tools(tools: Any, param: str = "tools") -> Tools | None:
    """`tools` as OpenAI defines them: function tools with a name and a JSON schema."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list of function tools", param=param)
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"{param}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidRequest("each tool must be {'type': 'function', ...}", param=where)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequest("a function tool needs a 'function' object", param=where)
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequest(
                "a function's name must be 1-64 letters, digits, '_' or '-'",
                param=f"{where}.function.name",
            )
        if name in names:
            raise InvalidRequest(f"two tools are named {name!r}", param=f"{where}.function.name")
        names.add(name)
        check_schema(fn.get("parameters"), f"{where}.function.parameters")
    return tools


def check_schema(schema: Any, param: str) -> None:
    """A JSON schema (absent: the function takes no parameters)."""
    if schema is None:
        return
    if not isinstance(schema, dict):
        raise InvalidRequest("parameters must be a JSON schema object", param=param)
    try:
        validators.validator_for(schema).check_schema(schema)
    except schema_errors.SchemaError as exc:
        raise InvalidRequest(f"not a valid JSON schema: {exc.message}", param=param) from None


def tool_names(tools: Tools | None) -> set[str]:
    return {t["function"]["name"] for t in tools or ()}


def check_tool_choice(choice: Any, tools: Tools | None) -> None:
    """`none`, `auto`, `required`, a named function among `tools`, or OpenAI's
    `allowed_tools` (`check_allowed_tools`)."""
    if choice is None or choice in ("none", "auto"):
        return
    if choice == "required":
        if not tools:
            raise InvalidRequest("tool_choice 'required' needs tools", param="tool_choice")
        return
    if isinstance(choice, str):
        raise InvalidRequest(
            f"tool_choice must be one of {', '.join(_CHOICES)}, a named function or allowed_tools",
            param="tool_choice",
        )
    if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
        check_allowed_tools(choice, tools)
        return
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not name:
        raise InvalidRequest(
            "a named tool_choice is {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    if name not in tool_names(tools):
        raise InvalidRequest(
            f"tool_choice names {name!r}, which is not a tool", param="tool_choice"
        )


def check_allowed_tools(choice: dict[str, Any], tools: Tools | None) -> None:
    """OpenAI's `{"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required",
    "tools": [{"type": "function", "function": {"name": ...}}, ...]}}`: calls restricted
    to a subset of `tools`, the whole list kept in the prompt (docs/agents.md)."""
    spec = choice.get("allowed_tools")
    usage = (
        "allowed_tools is {'type': 'allowed_tools', 'allowed_tools': {'mode': 'auto' | "
        "'required', 'tools': [{'type': 'function', 'function': {'name': ...}}]}}"
    )
    if not isinstance(spec, dict) or set(choice) - {"type", "allowed_tools"}:
        raise InvalidRequest(usage, param="tool_choice")
    if spec.get("mode") not in ALLOWED_MODES:
        raise InvalidRequest(
            f"allowed_tools mode must be auto or required, not {spec.get('mode')!r}",
            param="tool_choice",
        )
    allowed = spec.get("tools")
    if not isinstance(allowed, list) or not allowed:
        raise InvalidRequest("allowed_tools needs a list of tools", param="tool_choice")
    names = tool_names(tools)
    for entry in allowed:
        fn = entry.get("function") if isinstance(entry, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(entry, dict) or entry.get("type") != "function" or not name:
            raise InvalidRequest(usage, param="tool_choice")
        if name not in names:
            raise InvalidRequest(
                f"allowed_tools names {name!r}, which is not a tool", param="tool_choice"
            )


def engine_tool_choice(choice: Any, tools: Tools | None) -> tuple[Any, Tools | None]:
    """The tool choice and tools the engine gets for a choice (checked), and the tools
    the prompt renders: `allowed_tools` (which vLLM 0.32 does not take) as its mode, with
    only the allowed tools, in their order in `tools`; anything else as it is."""
    if not (isinstance(choice, dict) and choice.get("type") == "allowed_tools"):
        return choice, tools
    spec = choice["allowed_tools"]
    allowed = {entry["function"]["name"] for entry in spec["tools"]}
    subset = [t for t in tools or () if t["function"]["name"] in allowed]
    return spec["mode"], subset


def passthrough_tool_choice(doc: dict[str, Any], raw: bytes) -> bytes:
    """A request without a session (`doc`, its JSON `raw`) as the engine takes it: with an
    `allowed_tools` choice (checked here, as vLLM 0.32 refuses it), its mode and only the
    allowed tools; the engine renders the prompt from those (docs/agents.md). `doc` is
    changed to match; anything else keeps its bytes."""
    choice = doc.get("tool_choice")
    if not (isinstance(choice, dict) and choice.get("type") == "allowed_tools"):
        return raw
    tools = check_tools(doc.get("tools"))
    check_allowed_tools(choice, tools)
    doc["tool_choice"], doc["tools"] = engine_tool_choice(choice, tools)
    return orjson.dumps(doc)


def check_response_format(fmt: Any) -> None:
    """`text`, `json_object`, or `json_schema` with a valid schema."""
    if fmt is None:
        return
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return
    if kind != "json_schema":
        raise InvalidRequest(
            "response_format type must be text, json_object or json_schema",
            param="response_format",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise InvalidRequest(
            "response_format json_schema needs {'name', 'schema'}",
            param="response_format.json_schema",
        )
    check_schema(spec.get("schema"), "response_format.json_schema.schema")


def check_agent_fields(body: dict[str, Any], tools: Tools | None) -> None:
    """Everything a chat turn carries for an agent, against the tools it will run with."""
    for field in LEGACY_FIELDS:
        if body.get(field) is not None:
            raise InvalidRequest(f"{field} is deprecated: use tools / tool_choice", param=field)
    check_tool_choice(body.get("tool_choice"), tools)
    check_response_format(body.get("response_format"))


def same_tools(a: Tools | None, b: Tools | None) -> bool:
    """Whether two tool lists render alike (key order does not matter; list order does)."""
    if not a or not b:
        return not a and not b
    opt = orjson.OPT_SORT_KEYS
    return orjson.dumps(a, option=opt) == orjson.dumps(b, option=opt)


def uses_chat_engine(body: dict[str, Any], tools: Tools | None) -> bool:
    """A turn the engine's chat endpoint must run: tools to parse, a choice or a format to
    enforce, logprobs to return (`parallel_tool_calls` or a `none` choice without tools, a
    `text` format: nothing to do there)."""
    fmt = body.get("response_format")
    return (
        bool(tools)
        or body.get("tool_choice") not in (None, "none")
        or (isinstance(fmt, dict) and fmt.get("type") != "text")
        or body.get("logprobs") not in (None, False)
        or body.get("top_logprobs") is not None
    )


def check_tool_messages(history: list[dict[str, Any]], new: list[dict[str, Any]]) -> None:
    """Each `tool` message answers a call of the assistant message before it (the session's
    last answer, or one sent in this turn), by its `tool_call_id`."""
    calls: set[str] = set()
    previous = history[-1] if history else None
    if previous is not None:
        calls = _call_ids(previous) if previous.get("role") == "assistant" else set()
    for i, message in enumerate(new):
        role = message.get("role")
        if role == "assistant":
            calls = _call_ids(message)
            continue
        if role != "tool":
            calls = set()
            continue
        call_id = message.get("tool_call_id")
        if not calls:
            raise InvalidRequest(
                "a tool message must follow an assistant message with tool_calls",
                param=f"messages[{i}]",
            )
        if call_id not in calls:
            raise InvalidRequest(
                f"tool_call_id {call_id!r} matches no call of the assistant message before it",
                param=f"messages[{i}].tool_call_id",
            )


def _call_ids(message: dict[str, Any]) -> set[str]:
    return {c.get("id") for c in message.get("tool_calls") or () if isinstance(c, dict)}


def assistant_message(message: dict[str, Any]) -> dict[str, Any]:
    """What the history keeps of an answer: content, tool calls and reasoning (vLLM hands
    it to the template, which renders it inside the open turn's chain of tool calls and
    drops it once the turn closes: docs/reasoning.md), as the chat template renders them
    when the conversation is rendered again."""
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    reasoning = message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        out["reasoning"] = reasoning
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [
            {
                "id": c.get("id"),
                "type": "function",
                "function": {
                    "name": (c.get("function") or {}).get("name"),
                    "arguments": (c.get("function") or {}).get("arguments") or "",
                },
            }
            for c in calls
        ]
    return out


class StreamedCalls:
    """Tool calls put together from a stream's deltas (OpenAI's: by `index`; the first delta
    of a call carries its id, type and name, the rest pieces of its arguments)."""

    def __init__(self) -> None:
        self.calls: dict[int, dict[str, Any]] = {}

    def add(self, deltas: list[dict[str, Any]] | None) -> None:
        for delta in deltas or ():
            call = self.calls.setdefault(
                int(delta.get("index") or 0),
                {"id": None, "type": "function", "function": {"name": None, "arguments": ""}},
            )
            if delta.get("id"):
                call["id"] = delta["id"]
            fn = delta.get("function") or {}
            if fn.get("name"):
                call["function"]["name"] = fn["name"]
            call["function"]["arguments"] += fn.get("arguments") or ""

    def list(self) -> list[dict[str, Any]]:
        return [self.calls[i] for i in sorted(self.calls)]
