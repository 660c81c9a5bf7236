"""Agents on a session, end to end on the real vLLM (the tiny preset, hermes tool parser):
the openai SDK with tools in a session turn, structured outputs and logprobs, the OpenAI
Agents SDK over the Responses API, LangChain's `bind_tools`, and the inputs a session
refuses without changing. A random-weight model calls a tool when the choice forces it
(named or `required`: vLLM's structured outputs), so the tests force it."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest

from tests.vllm_connector.conftest import VLLM_TIMEOUT, VllmStack, document

pytestmark = pytest.mark.timeout(VLLM_TIMEOUT)
BLOCK = 128  # vLLM's CPU block: a turn reuses its history less at most one block
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 160}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,  # vLLM holds the arguments to the schema only when strict
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "the time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
TOOLS = [WEATHER, TIME]


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@pytest.fixture
def stack(vllm_stack: VllmStack) -> VllmStack:
    """The run's shared default stack (its vLLM has the hermes tool parser)."""
    return vllm_stack


@pytest.fixture
def client(stack: VllmStack) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def create(stack: VllmStack, seed: int, tools: list[dict[str, Any]] | None = TOOLS) -> str:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "system", "content": document(seed, 300)}],
    }
    if tools is not None:
        body["tools"] = tools
    got = stack.http.post("/v1/context", json=body)
    assert got.status_code == 200, got.text
    return str(got.json()["session_id"])


def context(stack: VllmStack, sid: str) -> dict[str, Any]:
    got = stack.http.get(f"/v1/context/{sid}")
    assert got.status_code == 200, got.text
    return dict(got.json())


def reused(usage: Any, history: int) -> None:
    """The turn reused its whole history but at most one engine block."""
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached >= history - BLOCK, (cached, history)


def test_tool_calls_in_a_session_with_the_openai_sdk(
    stack: VllmStack, client: openai.OpenAI
) -> None:
    """Named choice, tool result, `required` with parallel calls streamed, several tool
    results, `auto`: each turn sends only its new messages and reuses the history."""
    sid = create(stack, 1)
    extra = {"session_id": sid}
    history = context(stack, sid)["context_tokens"]
    r1 = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "what is the weather in paris"}],
        tools=TOOLS,
        tool_choice=named("get_weather"),
        extra_body=extra,
        **GREEDY,
    )
    choice = r1.choices[0]
    assert choice.finish_reason == "stop", choice  # OpenAI's, for a named choice
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.id
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    reused(r1.usage, history)

    history = context(stack, sid)["context_tokens"]
    r2 = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}],
        extra_body=extra,  # the session's tools are used: not sent again
        **GREEDY,
    )
    assert r2.choices[0].message.content is not None
    reused(r2.usage, history)

    history = context(stack, sid)["context_tokens"]
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "and the time there"}],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=True,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
        **GREEDY,
    )
    calls: dict[int, dict[str, str]] = {}
    finish, usage = None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                got = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                got["id"] = d.id or got["id"]
                got["name"] = (d.function and d.function.name) or got["name"]
                got["arguments"] += (d.function and d.function.arguments) or ""
    # a random model may go on calling until max_tokens: then the last call may be cut
    assert finish in ("tool_calls", "length") and len(calls) >= 1, (finish, calls)
    for got in list(calls.values())[: -1 if finish == "length" else None]:
        assert got["id"] and got["name"] in ("get_weather", "get_time")
        json.loads(got["arguments"])
    reused(usage, history)

    history = context(stack, sid)["context_tokens"]
    results = [
        {"role": "tool", "tool_call_id": got["id"], "content": f"result {i}"}
        for i, got in enumerate(calls.values())
    ]
    r4 = client.chat.completions.create(
        model="tiny", messages=results, tools=TOOLS, tool_choice="auto", extra_body=extra, **GREEDY
    )
    assert r4.choices[0].finish_reason in ("stop", "length")
    reused(r4.usage, history)
    info = context(stack, sid)
    assert info["turns"] == 5  # the create and four turns


def test_a_tool_call_equals_the_whole_conversation_sent_without_a_session(
    stack: VllmStack, client: openai.OpenAI
) -> None:
    """Greedy, the same engine: the session turn's call is the one vLLM gives the whole
    conversation (tools rendered by the template, a text turn before it)."""
    system = document(2, 300)
    sid = create(stack, 2)
    kwargs: dict[str, Any] = {"tools": TOOLS, "tool_choice": "required", **GREEDY}
    turn, full = turn_and_whole(client, sid, system, "weather in rome please", kwargs)
    calls = [(c.function.name, c.function.arguments) for c in turn.choices[0].message.tool_calls]
    expected = [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls]
    assert calls == expected
    assert turn.usage.prompt_tokens == full.usage.prompt_tokens


def turn_and_whole(
    client: openai.OpenAI, sid: str, system: str, question: str, kwargs: dict[str, Any]
) -> tuple[Any, Any]:
    """A plain turn ("hello there"), then `question` with `kwargs` (tools, a choice) as a
    session turn — and the same whole conversation sent without a session."""
    first = [{"role": "user", "content": "hello there"}]
    r1 = client.chat.completions.create(
        model="tiny", messages=first, extra_body={"session_id": sid}, **GREEDY
    )
    ask = [{"role": "user", "content": question}]
    turn = client.chat.completions.create(
        model="tiny", messages=ask, extra_body={"session_id": sid}, **kwargs
    )
    whole = [
        {"role": "system", "content": system},
        *first,
        {"role": "assistant", "content": r1.choices[0].message.content},
        *ask,
    ]
    explicit = {"prompt_cache_options": {"mode": "explicit"}}  # (passed through to vLLM)
    body = {**kwargs, "extra_body": {**kwargs.get("extra_body", {}), **explicit}}
    return turn, client.chat.completions.create(model="tiny", messages=whole, **body)


def test_structured_output_and_logprobs_in_a_session(
    stack: VllmStack, client: openai.OpenAI
) -> None:
    sid = create(stack, 3, tools=None)
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "a person please"}],
        response_format=fmt,  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=2,
        extra_body={"session_id": sid},
        temperature=0,
        max_tokens=400,
    )
    choice = r.choices[0]
    jsonschema.validate(json.loads(choice.message.content or ""), schema)
    assert choice.logprobs is not None and choice.logprobs.content
    assert len(choice.logprobs.content[0].top_logprobs) == 2


def test_bad_agent_inputs_are_refused_and_change_nothing(
    stack: VllmStack, client: openai.OpenAI
) -> None:
    sid = create(stack, 4)
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "weather"}],
        tool_choice=named("get_weather"),
        extra_body={"session_id": sid},
        **GREEDY,
    )
    (call,) = r.choices[0].message.tool_calls or []
    before = context(stack, sid)
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
    huge = "word " * 5000  # over the tiny model's 4,096-token window
    cases: list[tuple[dict[str, Any], str, str]] = [
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [bad_tool]},
            "tools[0].function.parameters",
            "invalid_request",
        ),
        (
            {"messages": [{"role": "tool", "tool_call_id": "call_nope", "content": "x"}]},
            "messages[0].tool_call_id",
            "invalid_request",
        ),
        (
            {"messages": [{"role": "tool", "tool_call_id": call.id, "content": huge}]},
            "messages",
            "context_length_exceeded",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": named("nope")},
            "tool_choice",
            "invalid_request",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "tool", "tool_call_id": call.id, "content": "y"},
                ]
            },
            "messages[1]",
            "invalid_request",
        ),
    ]
    for extra, param, code in cases:
        body = {"model": "tiny", "session_id": sid, **GREEDY, **extra}
        got = stack.http.post("/v1/chat/completions", json=body)
        assert got.status_code == 400, (extra, got.text)
        error = got.json()["error"]
        assert (error["param"], error["code"]) == (param, code), error
    after = context(stack, sid)
    assert (after["turns"], after["context_tokens"]) == (before["turns"], before["context_tokens"])
    fresh = create(stack, 5, tools=None)  # a tool message in a session with no call before it
    body = {"model": "tiny", "session_id": fresh, **GREEDY}
    body["messages"] = [{"role": "tool", "tool_call_id": "c1", "content": "y"}]
    got = stack.http.post("/v1/chat/completions", json=body)
    assert got.status_code == 400 and got.json()["error"]["param"] == "messages[0]", got.text


def test_an_agent_of_the_openai_agents_sdk_over_responses(stack: VllmStack) -> None:
    """An agent with a function tool, three tool round trips a run, its model calls chained
    with `previous_response_id` (the SDK then sends only the new items: the function call's
    output); a second run continues the first, streamed. Every model call after the first
    reuses the chain's history. (The tool choice is forced and kept, and the run ends after
    three round trips: a random-weight model would never end a text answer by itself.)"""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        RunConfig,
        Runner,
        ToolsToFinalOutputResult,
        function_tool,
    )

    seen: list[str] = []

    @function_tool  # (an enum: a random model writes any string, up to max_tokens)
    def get_weather(city: Literal["paris", "rome", "oslo"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"the weather in {city} is sunny"

    def every_third(_: Any, results: list[Any]) -> ToolsToFinalOutputResult:
        return ToolsToFinalOutputResult(
            is_final_output=len(seen) % 3 == 0, final_output=results[-1].output
        )

    async def run() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused")
        agent = Agent(
            name="weather",
            instructions=document(6, 200),
            tools=[get_weather],
            model=OpenAIResponsesModel(model="tiny", openai_client=client),
            model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=160),
            tool_use_behavior=every_third,
            reset_tool_choice=False,
        )
        config = RunConfig(tracing_disabled=True)
        first = await Runner.run(agent, "paris?", run_config=config, auto_previous_response_id=True)
        streamed = Runner.run_streamed(
            agent,
            "rome?",
            previous_response_id=first.last_response_id,
            auto_previous_response_id=True,
            run_config=config,
        )
        async for _ in streamed.stream_events():
            pass
        await client.close()
        return [*first.raw_responses, *streamed.raw_responses]

    responses = asyncio.run(run())
    assert len(seen) == 6 and len(responses) == 6, (seen, responses)
    for before, r in itertools.pairwise(responses):
        history = before.usage.input_tokens + before.usage.output_tokens
        assert r.usage.input_tokens_details.cached_tokens >= history - BLOCK, (history, r.usage)


def test_langchain_bind_tools_with_a_session(stack: VllmStack) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    sid = create(stack, 7)
    llm = ChatOpenAI(
        model="tiny",
        base_url=f"{stack.url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        temperature=0,
        max_tokens=160,  # type: ignore[call-arg]
        extra_body={"session_id": sid},
    )
    bound = llm.bind_tools([WEATHER, TIME], tool_choice="get_time")
    first = bound.invoke([HumanMessage("what time is it")])
    (call,) = first.tool_calls
    assert call["name"] == "get_time" and call["args"]["zone"] in ("utc", "cet")
    history = context(stack, sid)["context_tokens"]
    second = llm.bind_tools([WEATHER, TIME]).invoke([ToolMessage("12:00", tool_call_id=call["id"])])
    cached = second.response_metadata["token_usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= history - BLOCK


def test_a_turn_with_other_tools_renders_the_conversation_again(
    stack: VllmStack, client: openai.OpenAI
) -> None:
    """A session made without tools, then a turn with them: the whole conversation is
    rendered again with the tools as a new prefix (counted), the answer is the whole
    conversation's, and the next turn reuses the new history."""
    system = document(8, 300)
    sid = create(stack, 8, tools=None)
    before = stack.http.get("/metrics").text
    kwargs: dict[str, Any] = {"tools": TOOLS, "tool_choice": named("get_weather"), **GREEDY}
    turn, full = turn_and_whole(client, sid, system, "weather in rome", kwargs)
    assert turn.usage.prompt_tokens == full.usage.prompt_tokens
    (call,) = turn.choices[0].message.tool_calls or []
    (expected,) = full.choices[0].message.tool_calls or []
    assert (call.function.name, call.function.arguments) == (
        expected.function.name,
        expected.function.arguments,
    )
    after = stack.http.get("/metrics").text
    assert rerenders(after) == rerenders(before) + 1
    history = context(stack, sid)["context_tokens"]
    assert history == turn.usage.prompt_tokens + turn.usage.completion_tokens  # replaced
    r3 = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "tool", "tool_call_id": call.id, "content": "rain"}],
        extra_body={"session_id": sid},
        **GREEDY,
    )
    reused(r3.usage, history)
    assert rerenders(stack.http.get("/metrics").text) == rerenders(after)


def rerenders(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("ctxcache_gateway_tool_rerenders_total "):
            return float(line.split()[1])
    return 0.0


def test_responses_function_calls_streamed_forked_and_in_a_conversation(
    stack: VllmStack, client: openai.OpenAI
) -> None:
    """The openai SDK's Responses: a function call streamed with its events, its output sent
    back alone with `previous_response_id`, a JSON-schema `text.format`, a fork from the
    first response, and a conversation that lists the call and its output as items."""
    tool = {
        "type": "function",
        "name": "get_time",
        "description": "the time in a timezone",
        "parameters": TIME["function"]["parameters"],
        "strict": True,
    }
    base: dict[str, Any] = {"model": "tiny", "temperature": 0, "max_output_tokens": 160}
    pick = {"type": "function", "name": "get_time"}
    events: list[str] = []
    with client.responses.stream(
        input="what time is it",
        tools=[tool],
        tool_choice=pick,
        **base,  # type: ignore[arg-type]
    ) as stream:
        for event in stream:
            events.append(event.type)
        first = stream.get_final_response()
    (call,) = [i for i in first.output if i.type == "function_call"]
    assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("utc", "cet")
    for kind in (
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ):
        assert kind in events, (kind, events)
    schema = {
        "type": "object",
        "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
        "required": ["hour"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "hour", "schema": schema, "strict": True}}
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "12:00 utc"}
    second = client.responses.create(
        input=[output],  # type: ignore[list-item]
        previous_response_id=first.id,
        tools=[tool],  # type: ignore[list-item]
        tool_choice="none",  # the final answer, in the format (vLLM: auto's tag would win)
        text=fmt,  # type: ignore[arg-type]
        **base,
    )
    assert second.output_text, second
    jsonschema.validate(json.loads(second.output_text), schema)
    history = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= history - BLOCK
    items = client.responses.input_items.list(second.id)
    assert [i.type for i in items.data] == ["function_call_output"]

    fork = client.responses.create(  # from the first response again: a fork
        input=[{**output, "output": "13:00 utc"}],  # type: ignore[list-item]
        previous_response_id=first.id,
        tools=[tool],  # type: ignore[list-item]
        **base,
    )
    assert fork.status in ("completed", "incomplete")
    assert fork.usage.input_tokens_details.cached_tokens >= history - BLOCK

    conv = client.conversations.create()
    in_conv = client.responses.create(
        input="what time is it",
        conversation=conv.id,
        tools=[tool],  # type: ignore[list-item]
        tool_choice=pick,  # type: ignore[arg-type]
        **base,
    )
    (conv_call,) = [i for i in in_conv.output if i.type == "function_call"]
    client.responses.create(
        input=[{"type": "function_call_output", "call_id": conv_call.call_id, "output": "9"}],  # type: ignore[list-item]
        conversation=conv.id,
        tools=[tool],  # type: ignore[list-item]
        **base,
    )
    kinds = [i.type for i in client.conversations.items.list(conv.id, order="asc").data]
    assert kinds[:3] == ["message", "function_call", "function_call_output"], kinds


def test_a_retried_tool_call_turn_answers_the_same_calls(stack: VllmStack) -> None:
    """With an `Idempotency-Key`, a retry of a tool-call turn (streamed or not) answers the
    first attempt's calls, with their ids, and appends nothing."""
    sid = create(stack, 9)
    for stream in (False, True):
        body = {
            "model": "tiny",
            "session_id": sid,
            "messages": [{"role": "user", "content": "weather in oslo"}],
            "tool_choice": named("get_weather"),
            "stream": stream,
            **GREEDY,
        }
        headers = {"idempotency-key": f"retry-{stream}"}
        answers = []
        for _ in range(2):
            got = stack.http.post("/v1/chat/completions", json=body, headers=headers)
            assert got.status_code == 200, got.text
            answers.append((got, calls_of(got, stream)))
        (first, calls), (again, replayed_calls) = answers
        assert calls and replayed_calls == calls
        assert again.headers.get("idempotent-replayed") == "true"
        assert first.headers.get("idempotent-replayed") is None
    assert context(stack, sid)["turns"] == 3  # the create and two turns, none twice


def calls_of(answer: Any, stream: bool) -> list[tuple[str, str, str]]:
    """(id, name, arguments) of each tool call in a chat answer or its stream."""
    if not stream:
        message = answer.json()["choices"][0]["message"]
        return [
            (c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in message["tool_calls"]
        ]
    calls: dict[int, list[str]] = {}
    for line in answer.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[6:]).get("choices") or []:
            for d in (choice.get("delta") or {}).get("tool_calls") or []:
                got = calls.setdefault(d["index"], ["", "", ""])
                fn = d.get("function") or {}
                got[0] = d.get("id") or got[0]
                got[1] = fn.get("name") or got[1]
                got[2] += fn.get("arguments") or ""
    return [(i, n, a) for i, n, a in (calls[k] for k in sorted(calls))]


PARIS = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NOW = {
    "type": "function",
    "function": {
        "name": "get_time",
        "strict": True,
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}


def chat(url: str, **body: Any) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "messages": PARIS,
        "tools": [CITY, NOW],
        "temperature": 0,
        "max_tokens": 100,
        "return_token_ids": True,
        **body,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return dict(r.json()["choices"][0])


def calls(choice: dict[str, Any]) -> list[tuple[str, Any]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in choice["message"].get("tool_calls") or []
    ]


@pytest.mark.parametrize(
    "tool_choice, finish, names",
    [
        # a named function: OpenAI's (and vLLM's) finish_reason is `stop`
        ({"type": "function", "function": {"name": "get_weather"}}, "stop", {"get_weather"}),
        ("required", "tool_calls", {"get_weather", "get_time"}),
    ],
)
def test_vllm_parses_a_forced_call_alike_from_messages_and_from_token_ids(
    stack: VllmStack, tool_choice: Any, finish: str, names: set[str]
) -> None:
    """vLLM alone (no gateway): the hermes parser reads a forced call out of the preset's
    output; with the same prompt as `kv_transfer_params.prompt_token_ids` (the gateway's
    way, docs/agents.md) the answer is the same, token for token."""
    vllm = stack.vllm.url
    choice = chat(vllm, tool_choice=tool_choice)
    assert choice["finish_reason"] == finish
    got = calls(choice)
    assert got and {name for name, _ in got} <= names
    allowed = {"get_weather": [{"city": "Paris"}, {"city": "Rome"}], "get_time": [{}]}
    assert all(args in allowed[name] for name, args in got)  # the schemas held
    assert not choice["message"].get("content")
    # the same prompt as token ids from vLLM's /tokenize: the same answer, token for token
    prompt = tokenize(vllm, PARIS, add_generation_prompt=True)
    again = chat(vllm, tool_choice=tool_choice, kv_transfer_params={"prompt_token_ids": prompt})
    assert again["token_ids"] == choice["token_ids"]
    assert calls(again) == got and again["finish_reason"] == finish
    # the answer, sent back as history, renders after the same prompt (append-only)
    answer = {"role": "assistant", "content": None, "tool_calls": choice["message"]["tool_calls"]}
    result = {"role": "tool", "tool_call_id": answer["tool_calls"][0]["id"], "content": "sunny"}
    history = tokenize(vllm, [*PARIS, answer, result], add_generation_prompt=True)
    assert history[: len(prompt)] == prompt and len(history) > len(prompt)


def tokenize(url: str, messages: list[dict[str, Any]], **body: Any) -> list[int]:
    r = httpx.post(
        f"{url}/tokenize",
        json={"model": "tiny", "messages": messages, "tools": [CITY, NOW], **body},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def test_allowed_tools_reach_vllm_as_a_choice_it_takes(
    stack: VllmStack, client: openai.OpenAI
) -> None:
    """OpenAI's `allowed_tools` choice (pydantic-ai's `ToolOrOutput`), which vLLM 0.32
    does not know: on a session turn and without a session, `required` over one of two
    tools answers a call of that tool, and the session's prompt is still rendered with
    both (its history reused)."""
    allowed = {
        "type": "allowed_tools",
        "allowed_tools": {"mode": "required", "tools": [named("get_time")]},
    }
    sid = create(stack, 7)
    history = context(stack, sid)["context_tokens"]
    messages: Any = [{"role": "user", "content": "what time is it in paris"}]
    r = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=TOOLS,
        tool_choice=allowed,  # type: ignore[arg-type]
        extra_body={"session_id": sid},
        **GREEDY,
    )
    calls = r.choices[0].message.tool_calls
    assert calls and {c.function.name for c in calls} == {"get_time"}  # type: ignore[union-attr]
    reused(r.usage, history)
    plain = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=TOOLS,
        tool_choice=allowed,
        **GREEDY,  # type: ignore[arg-type]
    )
    calls = plain.choices[0].message.tool_calls
    assert calls and {c.function.name for c in calls} == {"get_time"}  # type: ignore[union-attr]


def test_a_vllm_refusal_without_a_session_comes_in_our_envelope(stack: VllmStack) -> None:
    """A request vLLM itself refuses (here: more tokens than the model's window) answers
    the OpenAI envelope every other error has: a string `code`, `invalid_request_error`,
    whether it was relayed to vLLM as it is or ran as a session turn."""
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 10**6}
    got = stack.http.post("/v1/completions", json=body)
    assert 400 <= got.status_code < 500, got.text
    error = got.json()["error"]
    assert error["type"] == "invalid_request_error" and isinstance(error["code"], str), error
