"""The workload and driver of `ctxcache bench agents --capacity`: many agents at a rate.

`agents` agent loops run at once, each replaced by a new agent when done, at an offered
rate of requests per second: capacity's driver (`benchmarks/capacity/capacity_load.py`:
its slots, the gap of `users / qps` seconds between a slot's requests, never before the
previous answer is in, the staggered first agents, new agents at every rate), with an
agent's loop in place of a user's questions.

An agent: the system prompt and the two tools of `agents.py` (the prompt padded to
`system_tokens`, the same for every agent: vLLM's prefix cache shares it), a user message
with its task (its own number and `task_tokens` of description), then `steps` requests
forced to call a tool (a named `tool_choice`, alternating), each call answered by a `tool`
message of `tool_tokens` tokens, and one request (`tool_choice: "none"`) answered in text.
The conversation grows by one call and one result a step.

- full-history modes: every request carries the whole conversation: the system prompt,
  the user message, and for each past step the assistant message with its `tool_calls`
  (the id, name and arguments the engine streamed) and the `tool` message answering it;
- `session`: the first request is a streamed `POST /v1/context` with the system prompt,
  the tools and the user message (the create answers the first call); each later one a
  session turn with only the new `tool` message. The session keeps the tokens the model
  generated for each call; the full-history modes send the call back as the chat template
  renders it, in other tokens. So from the second step on the two prompts differ (compare
  their `prompt_tokens`), and so may their greedy answers.

The words are deterministic per agent number (tool results and task descriptions drawn
from pools made once, so a new agent costs no tokenizing mid-run).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import orjson

from benchmarks.agents.agents import SYSTEM, TOOLS, USER, tool_choice
from benchmarks.agents.agents_ways import (
    Answer,
    assistant_message,
    read_chat,
    tool_messages,
    whole_calls,
)
from benchmarks.capacity.capacity_load import Driver, Sent, Step
from benchmarks.multiturn.multiturn import user_message

SHARED_SYSTEM = SYSTEM.replace(" on task {task:06d}", "")  # every agent's: no task number
POOL = 16  # tool results (and task descriptions) made once, drawn per agent


@dataclass(frozen=True)
class AgentWorkload:
    agents: int = 8
    steps: int = 8  # requests answered by a tool call; one more answers in text
    system_tokens: int = 1000  # the shared system prompt's padding (the tools come beside)
    task_tokens: int = 200  # each agent's task description, in its user message
    tool_tokens: int = 600  # each tool result
    max_tokens: int = 128

    # what capacity's driver reads: its slots and the requests of one of them
    @property
    def users(self) -> int:
        return self.agents

    @property
    def rounds(self) -> int:
        return self.steps + 1


@dataclass(frozen=True)
class Agent:
    opening: list[dict[str, Any]]  # the system prompt and the user message
    results: list[str]  # the result answering each step's call


class AgentTexts:
    """The words of every agent, by agent number (what capacity's driver calls `texts`)."""

    def __init__(self, workload: AgentWorkload, tokenizer: Any, seed: int = 0) -> None:
        self.w, self.seed = workload, seed
        rng = random.Random(seed)
        pad = user_message(rng, max(1, workload.system_tokens), tokenizer)
        self.system = f"{SHARED_SYSTEM} {pad}"
        self.results = [user_message(rng, workload.tool_tokens, tokenizer) for _ in range(POOL)]
        self.tasks = [user_message(rng, workload.task_tokens, tokenizer) for _ in range(POOL)]

    def user(self, k: int) -> Agent:
        rng = random.Random(self.seed * 1_000_003 + 7919 * (k + 1))
        task = f"Task {k:06d}. {USER} {rng.choice(self.tasks)}"
        opening = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": task},
        ]
        return Agent(opening, [rng.choice(self.results) for _ in range(self.w.steps)])


def answer_text(answer: Answer) -> str:
    """What is compared across modes: the calls' names and arguments (not their ids, which
    every engine makes up), else the text."""
    if answer.calls:
        return "; ".join(f"{c.name}({c.arguments})" for c in answer.calls)
    return answer.text


class AgentLoop:
    """One agent's requests (capacity's `Conversation`): each step forced to call a tool
    (the last one answered in text), each call answered by its tool result."""

    def __init__(self, workload: AgentWorkload, agent: Agent) -> None:
        self.w, self.agent = workload, agent
        self.history: list[dict[str, Any]] = list(agent.opening)  # the whole conversation
        self.new: list[dict[str, Any]] = list(agent.opening)  # what a session turn sends

    def step(self, n: int) -> Step:
        fields = {
            "tools": TOOLS,
            "tool_choice": tool_choice(n - 1, self.w.steps),
            "max_tokens": self.w.max_tokens,
        }
        return Step(self.history, self.new, fields)

    def answered(self, step: Step, answer: Any, rec: Sent) -> bool:
        n, steps = rec.round, self.w.steps
        if rec.error is None and n <= steps and not whole_calls(answer):
            rec.error = f"step {n}: no whole tool call in {answer} (--max-tokens?)"
        if rec.error is not None or n > steps:
            return False  # the loop cannot go on without its call
        self.new = tool_messages(answer.calls, self.agent.results[n - 1])
        self.history = [*self.history, assistant_message(answer), *self.new]
        return True


class AgentDriver(Driver):
    """Capacity's driver with an agent's loop for a user's questions."""

    texts: AgentTexts

    def _conversation(self, k: int) -> AgentLoop:
        return AgentLoop(self.texts.w, self.texts.user(k))

    async def _stream(
        self, http: Any, body: dict[str, Any], rec: Sent, path: str = "/v1/chat/completions"
    ) -> tuple[Answer, str | None]:
        """Stream one request into `rec` (TTFT: the first chunk with content or a tool-call
        delta); the answer, and the session a streamed create made, if any."""
        answer = Answer()
        stamps: list[float] = []
        start = time.perf_counter()
        created = None
        try:
            async with http.stream("POST", path, content=orjson.dumps(body)) as r:
                if r.status_code != 200:
                    await r.aread()
                    rec.error = f"{r.status_code}: {r.text[:200]}"
                    return answer, None
                created = r.headers.get("x-session-id")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = orjson.loads(line[6:])
                    if "error" in chunk:
                        rec.error = f"in the stream: {line[6:206]}"
                    if read_chat(answer, chunk):
                        stamps.append(time.perf_counter())
        except Exception as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
            return answer, None
        rec.total = time.perf_counter() - start
        rec.ttft = (stamps[0] - start) if stamps else rec.total
        if len(stamps) > 1:
            rec.itl = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
        rec.prompt_tokens = answer.prompt_tokens or 0
        rec.cached_tokens = answer.cached_tokens or 0
        rec.completion_tokens = answer.completion_tokens or 0
        rec.answer = answer_text(answer)
        return answer, created
