"""Reasoning models on a session (docs/reasoning.md), at the manager and worker boundaries:
a fake manager and a toy template that, like Qwen3's, drops the reasoning of closed turns.
The same paths run on the real vLLM with the thinking preset in
tests/vllm_connector/test_reasoning_vllm.py."""

from __future__ import annotations

import time
from typing import Any

import pytest

from cache_manager.protocol import AppendTurn, BeginTurn, SessionInfo, SessionState
from ctxcache.errors import InvalidRequest
from gateway.metrics import GatewayMetrics
from gateway.pool import Worker, WorkerPool
from gateway.prompts import PromptBuilder
from gateway.reasoning import Reasoning, template_kwargs
from gateway.salt import CacheSalt
from gateway.settings import GatewaySettings, WorkerEndpoint
from gateway.turn_engine import Generation, StreamedAnswer, TurnEngine
from gateway.turns import TurnService

SID = "ctx_" + "b" * 32
THINK = "<think>let me see</think>"
U1 = {"role": "user", "content": "hello"}
A1 = {"role": "assistant", "content": "hi!", "reasoning": "let me see"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
A1_CALL = {"role": "assistant", "content": "f()", "tool_calls": [CALL], "reasoning": "let me see"}


def render(
    messages: list[dict[str, Any]], *, gen: bool = False, kwargs: dict[str, Any] | None = None
) -> list[int]:
    """A toy thinking template, Qwen3's rule: `<role>content|` per message; an assistant
    message after the last user message shows its reasoning (`<think>...</think>`; the
    last one always, empty without reasoning), the closed turns' lose it; `<assistant>` to
    generate, `<think></think>` after it when thinking is off."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    text = ""
    for i, m in enumerate(messages):
        reasoning = m.get("reasoning") or ""
        last = i == len(messages) - 1
        shown = m["role"] == "assistant" and i > last_user and (last or reasoning)
        think = f"<think>{reasoning}</think>" if shown else ""
        text += f"<{m['role']}>{think}{m.get('content') or ''}|"
    if gen:
        text += "<assistant>"
        if (kwargs or {}).get("enable_thinking") is False:
            text += "<think></think>"
    return list(text.encode())


class Prompts(PromptBuilder):
    """`/tokenize` without HTTP: text as its bytes, messages with `render`."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[dict[str, Any]] = []

    async def tokenize(self, worker: Worker, body: dict[str, Any]) -> tuple[list[int], int]:
        self.bodies.append(body)
        if "messages" in body:
            if body.get("continue_final_message"):
                return render(body["messages"])[:-1], 4096
            gen = body["add_generation_prompt"]
            return render(body["messages"], gen=gen, kwargs=body.get("chat_template_kwargs")), 4096
        return list(body["prompt"].encode()), 4096


class Manager:
    """A chat session of one closed turn whose answer was generated with its thinking."""

    def __init__(self, history: list[dict[str, Any]], rule: str = "template") -> None:
        self.history = history
        answer = THINK + (history[-1].get("content") or "") + "|"
        self.tokens = render(history[:-1], gen=True) + list(answer.encode())
        self.rule = rule
        self.begins = 0
        self.appended: list[AppendTurn] = []

    def info(self, version: int = 1) -> SessionInfo:
        return SessionInfo(
            session_id=SID,
            tenant="t",
            model="m",
            kind="chat",
            created=0,
            last_used=0,
            ttl=60,
            expires_at=int(time.time()) + 60,
            turns=1,
            version=version,
            context_tokens=len(self.tokens),
            reasoning_history=self.rule,  # type: ignore[arg-type]
        )

    async def begin(self, session_id: str, req: BeginTurn) -> SessionState:
        self.begins += 1
        return SessionState(
            info=self.info(), tokens=self.tokens, messages=self.history, lock="lock"
        )

    async def append(self, session_id: str, req: AppendTurn) -> SessionInfo:
        self.appended.append(req)
        return self.info(version=req.expected_version + 1)

    async def release(self, session_id: str, tenant: str, lock: str) -> None:
        pass


def service(manager: Manager, parser: str | None = "qwen3") -> TurnService:
    pool = WorkerPool(
        [WorkerEndpoint(id="w0", url="http://127.0.0.1:9")],
        connect_timeout_s=1,
        request_timeout_s=1,
        health_interval_s=60,
        imbalance_slack=4,
        max_inflight=64,
    )
    for w in pool.workers:
        w.healthy, w.models = True, {"m": 4096}
    return TurnService(
        manager,  # type: ignore[arg-type]
        pool,
        GatewayMetrics(),
        Prompts(),
        reasoning=Reasoning(parser),
    )


def chat(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), "max_tokens": 4, **fields}


U2 = {"role": "user", "content": "and?"}


async def test_a_new_user_message_rebases_on_the_templates_rendering() -> None:
    """Under `template`, the closed turn's reasoning goes as the template drops it: the
    prompt is exactly the whole conversation's rendering (a stateless client's), and the
    commit replaces the stored ids with it once; only the tokens from the first
    difference on are new to the engine."""
    manager = Manager([U1, A1])
    turns = service(manager)
    turn = await turns.begin("t", SID, "chat", chat(U2))
    whole = render([U1, A1, U2], gen=True)
    assert turn.prompt == whole and turn.new_tokens == whole  # type: ignore[union-attr]
    assert turn.replace and turn.chat_engine  # type: ignore[union-attr]
    same = len(render([U1], gen=True))  # the stored ids and the rendering part at the answer
    assert manager.tokens[:same] == whole[:same] and manager.tokens[same] != whole[same]
    assert turn.rebase == len(whole) - same  # type: ignore[union-attr]
    gen = Generation("ok", [1, 2], "stop", {"prompt_tokens": len(whole)}, worker=turn.worker)  # type: ignore[union-attr]
    await turns.commit(turn, gen)  # type: ignore[arg-type]
    (append,) = manager.appended
    assert append.replace and append.tokens == [*whole, 1, 2]
    assert append.messages == [U2, {"role": "assistant", "content": "ok"}]  # (no reasoning)
    assert turns.metrics.reasoning_rebases._value.get() == 1
    assert turns.metrics.reasoning_rebase_tokens._value.get() == len(whole) - same


async def test_keep_appends_after_the_exact_generated_ids() -> None:
    manager = Manager([U1, A1], rule="keep")
    turn = await service(manager).begin("t", SID, "chat", chat(U2))
    assert turn.prompt[: len(manager.tokens)] == manager.tokens  # type: ignore[union-attr]
    assert not turn.replace and turn.rebase == 0  # type: ignore[union-attr]
    # (no answer twice: the template renders the closed answer otherwise, `PromptBuilder.after`)
    assert turn.prompt[len(manager.tokens) :] == list(b"<user>and?|<assistant>")  # type: ignore[union-attr]


@pytest.mark.parametrize("kept", [True, False])
async def test_inside_a_chain_of_tool_calls_the_reasoning_stays(kept: bool) -> None:
    """A tool result continues the user turn: the template keeps its reasoning too, and
    the session keeps its exact ids. With the reasoning in the history (`kept`), they are
    the conversation's rendering; without (a session of before), the tool result follows
    them all the same, once."""
    call = A1_CALL if kept else {k: v for k, v in A1_CALL.items() if k != "reasoning"}
    manager = Manager([U1, call])
    tool = {"role": "tool", "tool_call_id": "c1", "content": "42"}
    turns = service(manager)
    turn = await turns.begin("t", SID, "chat", chat(tool))
    assert turn.prompt == manager.tokens + list(b"<tool>42|<assistant>")  # type: ignore[union-attr]
    assert not turn.replace  # type: ignore[union-attr]
    # (without: the history alone, the closing probe, the two `PROBES` besides)
    assert len(turns.prompts.bodies) == (1 if kept else 6)  # type: ignore[attr-defined]


async def test_without_a_reasoning_parser_the_ids_are_kept() -> None:
    """A deployment that knows of no thinking keeps today's rule, and runs plain turns on
    the engine's completions."""
    manager = Manager([U1, A1])
    turn = await service(manager, parser=None).begin("t", SID, "chat", chat(U2))
    assert turn.prompt[: len(manager.tokens)] == manager.tokens  # type: ignore[union-attr]
    assert not turn.replace and not turn.chat_engine  # type: ignore[union-attr]


async def test_the_effort_and_template_kwargs_reach_the_template() -> None:
    manager = Manager([U1, A1], rule="keep")
    turns = service(manager)
    body = chat(U2, reasoning_effort="none", chat_template_kwargs={"x": 1})
    turn = await turns.begin("t", SID, "chat", body)
    kwargs = {"x": 1, "reasoning_effort": "none", "enable_thinking": False}
    assert turns.prompts.bodies[0]["chat_template_kwargs"] == kwargs  # type: ignore[attr-defined]
    assert turn.prompt[-len(b"<think></think>") :] == list(b"<think></think>")  # type: ignore[union-attr]
    # the engine gets them too: its parser reads the kwargs (thinking off: all content)
    sent = TurnEngine(turns.pool, turns.metrics, CacheSalt(False))._worker_body(turn, stream=False)  # type: ignore[arg-type]
    assert sent["reasoning_effort"] == "none" and sent["chat_template_kwargs"] == {"x": 1}
    assert sent["kv_transfer_params"]["prompt_token_ids"] == turn.prompt  # type: ignore[union-attr]


async def test_a_plain_turn_on_the_engines_completions_gets_no_template_fields() -> None:
    turns = service(Manager([U1, A1]), parser=None)
    turn = await turns.begin("t", SID, "chat", chat(U2, reasoning_effort="none"))
    sent = TurnEngine(turns.pool, turns.metrics, CacheSalt(False))._worker_body(turn, stream=False)  # type: ignore[arg-type]
    assert "reasoning_effort" not in sent and sent["prompt"] == turn.prompt  # type: ignore[union-attr]


def test_template_kwargs_as_vllm_adds_them() -> None:
    assert template_kwargs({}) is None
    assert template_kwargs({"reasoning_effort": "high"}) == {
        "reasoning_effort": "high",
        "enable_thinking": True,
    }
    given = {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}}
    assert template_kwargs(given) == {"enable_thinking": False, "reasoning_effort": "low"}


@pytest.mark.parametrize(
    ("parser", "fields", "param"),
    [
        ("qwen3", {"reasoning_effort": "extreme"}, "reasoning_effort"),
        ("qwen3", {"reasoning_effort": 3}, "reasoning_effort"),
        ("qwen3", {"chat_template_kwargs": "x"}, "chat_template_kwargs"),
        ("qwen3", {"include_reasoning": "yes"}, "include_reasoning"),
        (None, {"reasoning_effort": "high"}, "reasoning_effort"),
        (
            None,
            {"chat_template_kwargs": {"enable_thinking": True}},
            "chat_template_kwargs.enable_thinking",
        ),
        (None, {"chat_template_kwargs": {"thinking": True}}, "chat_template_kwargs.thinking"),
    ],
)
async def test_refused_before_the_session_is_loaded(
    parser: str | None, fields: dict[str, Any], param: str
) -> None:
    manager = Manager([U1, A1])
    with pytest.raises(InvalidRequest) as err:
        await service(manager, parser).begin("t", SID, "chat", chat(U2, **fields))
    assert err.value.param == param and err.value.status == 400
    assert manager.begins == 0 and not manager.appended  # nothing locked, nothing written


@pytest.mark.parametrize(
    "fields",
    [{"reasoning_effort": "none"}, {"chat_template_kwargs": {"enable_thinking": False}}, {}],
)
def test_thinking_off_needs_no_parser(fields: dict[str, Any]) -> None:
    Reasoning(None).check(chat(U2, **fields))


def test_the_parser_setting() -> None:
    assert GatewaySettings().reasoning_parser is None
    assert GatewaySettings(reasoning_parser="none").reasoning_parser is None
    assert GatewaySettings(reasoning_parser="qwen3").reasoning_parser == "qwen3"


def test_a_streamed_answer_keeps_the_whole_reasoning() -> None:
    """The deltas' pieces of thinking make the message's `reasoning` (the contract the
    Responses side reads: `Generation.message["reasoning"]`), apart from the content."""

    class Call:
        def relayed(self, n: int) -> None:
            pass

    class Turn:
        chat_engine = True

    answer = StreamedAnswer(Turn(), Call())  # type: ignore[arg-type]
    for delta in [
        {"role": "assistant", "content": ""},
        {"reasoning": "let "},
        {"reasoning": "me see"},
        {"content": "hi"},
        {"content": "!"},
    ]:
        answer.add({"delta": delta, "token_ids": [1]})
    gen = answer.generation({"prompt_tokens": 3}, None, GatewayMetrics())  # type: ignore[arg-type]
    assert gen.message is not None
    assert gen.message["reasoning"] == "let me see" and gen.message["content"] == "hi!"
    assert gen.message["role"] == "assistant" and gen.text == "hi!"
    # the history keeps it, for the template to render inside the open turn
    assert gen.assistant() == {"role": "assistant", "content": "hi!", "reasoning": "let me see"}
