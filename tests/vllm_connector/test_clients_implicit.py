"""Real clients, unmodified and without `session_id`, on the real vLLM (issue 55's implicit
sessions): a chat loop and a tool loop over the `openai` SDK, a LangGraph ReAct agent, the
OpenAI Agents SDK's chat-completions model and pydantic-ai's OpenAI model with its
`ToolOrOutput` choice. Each resends the whole conversation on every step, and every step
after the first reuses the previous step's prompt but at most one block, with vLLM's own
prefix cache emptied before each step (`wire.Wire`), and counts as an implicit hit.

And the same LangGraph agent given `session_id` (an explicit session): its steps resend the
session's history, which is not appended again (`gateway/resent.py`): its prompts grow as
the run's without a session do.

A random-weight model calls a tool when the choice forces it (named or `required`), so the
agents force it, and end after a few steps by a choice of `none` or their own rule."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel

from tests.vllm_connector.conftest import VLLM_TIMEOUT, VllmStack, document
from tests.vllm_connector.test_agents_vllm import TOOLS, named
from tests.vllm_connector.wire import Wire

pytestmark = pytest.mark.timeout(VLLM_TIMEOUT)
# (a forced call needs room: a random model pads its JSON with whitespace up to ~100 tokens)
MAX_TOKENS = 160
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": MAX_TOKENS}


@pytest.fixture
def wire(vllm_stack: VllmStack) -> Iterator[Wire]:
    wire = Wire(vllm_stack)
    yield wire
    wire.close()


@pytest.fixture
def client(vllm_stack: VllmStack, wire: Wire) -> Iterator[openai.OpenAI]:
    url = f"{vllm_stack.url}/v1"
    with openai.OpenAI(base_url=url, api_key="unused", http_client=wire.client()) as c:
        yield c


def test_a_chat_loop_of_the_openai_sdk(client: openai.OpenAI, wire: Wire) -> None:
    """Four turns, the answer's text appended as a user's loop does; the third streamed."""
    messages: list[Any] = [{"role": "system", "content": document(40, 300)}]
    for i, question in enumerate(("hello there", "and the cat?", "the dogs?", "rain?")):
        messages.append({"role": "user", "content": question})
        if i == 2:
            stream = client.chat.completions.create(
                model="tiny",
                messages=messages,
                stream=True,
                stream_options={"include_usage": True},
                temperature=0,
                max_tokens=48,
            )
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        else:
            r = client.chat.completions.create(
                model="tiny", messages=messages, temperature=0, max_tokens=48
            )
            text = r.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
    assert len(wire.steps) == 4
    wire.implicit_every_step()


def test_a_tool_loop_of_the_openai_sdk(client: openai.OpenAI, wire: Wire) -> None:
    """A named call, its result, another named call, its result, then `auto`: each answer
    echoed back as the SDK gives it (`model_dump(exclude_none=True)`)."""
    messages: list[Any] = [
        {"role": "system", "content": document(41, 300)},
        {"role": "user", "content": "the weather in paris, and the time there"},
    ]
    for choice in (named("get_weather"), named("get_time")):
        r = client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, tool_choice=choice, **GREEDY
        )
        message = r.choices[0].message
        (call,) = message.tool_calls or []
        messages.append(message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 12:00"})
    last = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, tool_choice="auto", **GREEDY
    )
    assert last.choices[0].finish_reason in ("stop", "length", "tool_calls")
    wire.implicit_every_step()


def test_an_agent_of_the_openai_agents_sdk_over_chat_completions(
    vllm_stack: VllmStack, wire: Wire
) -> None:
    """An agent with a function tool on `OpenAIChatCompletionsModel`: three tool round trips
    a run, each model call resending the whole run; a second run, streamed, continues the
    first from its `to_input_list()` (the SDK's way without server-side state)."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        ToolsToFinalOutputResult,
        function_tool,
    )

    seen: list[str] = []

    @function_tool
    def get_weather(city: Literal["paris", "rome", "oslo"]) -> str:
        """The weather in a city."""
        seen.append(city)
        return f"the weather in {city} is sunny"

    def every_third(_: Any, results: list[Any]) -> ToolsToFinalOutputResult:
        return ToolsToFinalOutputResult(
            is_final_output=len(seen) % 3 == 0, final_output=results[-1].output
        )

    async def run() -> None:
        url = f"{vllm_stack.url}/v1"
        http = wire.async_client()
        async with openai.AsyncOpenAI(base_url=url, api_key="unused", http_client=http) as client:
            agent = Agent(
                name="weather",
                instructions=document(42, 300),
                tools=[get_weather],
                model=OpenAIChatCompletionsModel(model="tiny", openai_client=client),
                model_settings=ModelSettings(
                    tool_choice="get_weather",
                    temperature=0,
                    max_tokens=MAX_TOKENS,
                    include_usage=True,
                ),
                tool_use_behavior=every_third,
                reset_tool_choice=False,
            )
            config = RunConfig(tracing_disabled=True)
            first = await Runner.run(agent, "paris?", run_config=config)
            again = [*first.to_input_list(), {"role": "user", "content": "and rome?"}]
            streamed = Runner.run_streamed(agent, again, run_config=config)  # type: ignore[arg-type]
            async for _ in streamed.stream_events():
                pass

    asyncio.run(run())
    assert len(seen) == 6 and len(wire.steps) == 6, (seen, wire.table())
    wire.implicit_every_step()


class Forecast(BaseModel):
    city: Literal["paris", "rome"]
    sky: Literal["sunny", "rain"]


def test_an_agent_of_pydantic_ai_with_tool_or_output(vllm_stack: VllmStack, wire: Wire) -> None:
    """pydantic-ai's OpenAI chat model with `ToolOrOutput(function_tools=["get_weather"])`
    over two function tools and a structured output: each request's choice is OpenAI's
    `allowed_tools` (`required` over the weather tool and the output tool); an output
    validator asks again until the agent made three requests."""
    from pydantic_ai import Agent, ModelRetry, RunContext, ToolOrOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    url = f"{vllm_stack.url}/v1"
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", http_client=wire.async_client())
    model = OpenAIChatModel("tiny", provider=OpenAIProvider(openai_client=client))
    settings = ModelSettings(
        tool_choice=ToolOrOutput(function_tools=["get_weather"]),
        parallel_tool_calls=False,  # (else a random model calls until max_tokens cuts it)
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    agent = Agent(
        model,
        output_type=Forecast,
        system_prompt=document(43, 300),
        model_settings=settings,
        retries=5,
    )

    @agent.tool_plain
    def get_weather(city: Literal["paris", "rome"]) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    @agent.tool_plain
    def get_time(zone: Literal["utc", "cet"]) -> str:
        """The time in a timezone."""
        return f"12:00 {zone}"

    @agent.output_validator
    def three_requests(ctx: RunContext[None], output: Forecast) -> Forecast:
        if len(wire.steps) < 3:
            raise ModelRetry("check the weather first")
        return output

    async def run() -> Forecast:
        async with client:
            return (await agent.run("the weather in paris?")).output

    assert isinstance(asyncio.run(run()), Forecast)
    for step in wire.steps:
        choice = step.body["tool_choice"]
        assert choice["type"] == "allowed_tools" and choice["allowed_tools"]["mode"] == "required"
        allowed = {t["function"]["name"] for t in choice["allowed_tools"]["tools"]}
        assert allowed == {"get_weather", "final_result"}, choice
        assert len(step.body["tools"]) == 3  # all of them: the prompt stays the same
    wire.implicit_every_step()


def react_tools() -> list[Any]:
    """The ReAct agent's LangChain tools."""
    from langchain_core.tools import tool

    @tool
    def get_weather(city: Literal["paris", "rome"]) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    @tool
    def get_time(zone: Literal["utc", "cet"]) -> str:
        """The time in a timezone."""
        return f"12:00 {zone}"

    return [get_weather, get_time]


def react_agent(stack: VllmStack, wire: Wire, extra_body: dict[str, Any] | None = None) -> Any:
    """LangGraph's ReAct agent over LangChain's `ChatOpenAI`: a weather call, a time call,
    then a text answer (the model picked per step: the choice is forced, then `none`)."""
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    llm = ChatOpenAI(
        model="tiny",
        base_url=f"{stack.url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        temperature=0,
        max_tokens=MAX_TOKENS,  # type: ignore[call-arg]
        http_client=wire.client(),
        extra_body=extra_body,
    )
    tools = react_tools()
    choices = ["get_weather", "get_time", "none"]

    def model(state: dict[str, Any], runtime: Any) -> Any:
        calls = sum(1 for m in state["messages"] if m.type == "tool")
        # (strict: vLLM holds a forced call's arguments to the schema only when strict)
        return llm.bind_tools(tools, tool_choice=choices[min(calls, 2)], strict=True)

    return create_react_agent(model, tools, prompt=REACT_PROMPT)


REACT_PROMPT = document(44, 300)
REACT_QUESTION = "the weather in paris, and the time there?"
# create_react_agent is deprecated for langchain.agents' create_agent (another package)
deprecated = pytest.mark.filterwarnings("ignore::langgraph.warnings.LangGraphDeprecatedSinceV10")


@pytest.fixture(scope="module")
def react_run(vllm_stack: VllmStack) -> Iterator[Wire]:
    """The ReAct agent's run without a session, once for the module."""
    wire = Wire(vllm_stack)
    result = react_agent(vllm_stack, wire).invoke({"messages": [("user", REACT_QUESTION)]})
    wire.close()
    assert [m.type for m in result["messages"]][-1] == "ai"
    assert len(wire.steps) == 3, wire.table()
    yield wire


@deprecated
def test_a_langgraph_react_agent(react_run: Wire) -> None:
    react_run.implicit_every_step()


@deprecated
def test_a_langgraph_react_agent_given_a_session_does_not_duplicate_its_history(
    vllm_stack: VllmStack, react_run: Wire, wire: Wire
) -> None:
    """The agent given `session_id` (created with its system prompt and tools) resends the
    session's history every step, which is not appended again: its prompts grow as the
    run's without a session do (the session keeping the model's own tokens of each call,
    the stateless run their rendering), and each step reuses the history."""
    from langchain_core.utils.function_calling import convert_to_openai_tool

    body = {
        "model": "tiny",
        "messages": [{"role": "system", "content": REACT_PROMPT}],
        "tools": [convert_to_openai_tool(t, strict=True) for t in react_tools()],
    }
    made = vllm_stack.http.post("/v1/context", json=body)
    assert made.status_code == 200, made.text
    agent = react_agent(vllm_stack, wire, {"session_id": made.json()["session_id"]})
    agent.invoke({"messages": [("user", REACT_QUESTION)]})
    plain, session = react_run.steps, wire.steps
    table = (react_run.table(), wire.table())
    assert len(session) == len(plain) == 3, table
    assert session[0].prompt == plain[0].prompt, table
    for i in (1, 2):
        # besides the model's own tokens of the step before (which the session keeps and
        # the plain run renders again, shorter): no more than the plain run's prompt grew.
        # A duplicated history would add the whole previous prompt (800 tokens and more)
        grew = session[i].prompt - session[i - 1].prompt - session[i - 1].completion
        assert grew <= plain[i].prompt - plain[i - 1].prompt, table
    wire.reused_every_step()
