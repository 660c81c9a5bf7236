"""Reasoning models (docs/reasoning.md): the reasoning parser the engines run, what a
request may ask of the template's thinking, and the rule for a session's past reasoning.

- With a parser (`CTX_GATEWAY_REASONING_PARSER`), every session chat turn runs on the
  engine's chat endpoint, whose parser puts the thinking in the message's `reasoning`
  (vLLM's field name) and only the answer in `content`.
- `reasoning_effort` and `chat_template_kwargs` reach the template: the gateway renders a
  session's prompt itself (`/tokenize`), with the kwargs vLLM's chat endpoint would add
  (`template_kwargs`).
- The rule (`reasoning_history`, chosen at create): `template` (the default) follows the
  template, which drops the reasoning of closed turns: when a user message closes the open
  turn and the stored ids are not a prefix of the conversation's rendering, the session is
  re-based on that rendering (`rebased`, committed with `replace`); inside a turn's chain
  of tool calls the exact ids stay. `keep` keeps the exact generated ids always.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ctxcache.errors import InvalidRequest

# vLLM 0.32's `reasoning_effort` (OpenAI's minimal | low | medium | high, and none, xhigh,
# max); "none" turns thinking off
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# the template kwargs that switch thinking on (Qwen3 and most: enable_thinking; DeepSeek
# V3.1: thinking)
THINKING_KWARGS = ("enable_thinking", "thinking")
# what a request gives the template (sent to the engine's chat endpoint, whose parser reads
# them too; not to its completions)
TEMPLATE_FIELDS = ("reasoning_effort", "chat_template_kwargs", "include_reasoning")
Rule = Literal["template", "keep"]
RULES: tuple[Rule, ...] = ("template", "keep")

Messages = list[dict[str, Any]]


def template_kwargs(body: dict[str, Any]) -> dict[str, Any] | None:
    """The kwargs the chat template gets for this request, as vLLM's chat endpoint passes
    them: the request's `chat_template_kwargs`, and with a `reasoning_effort` the effort
    (over the kwargs' own) and `enable_thinking` (effort != none) unless given."""
    kwargs = body.get("chat_template_kwargs")
    effort = body.get("reasoning_effort")
    out = dict(kwargs) if isinstance(kwargs, dict) else {}
    if effort is not None:
        out["reasoning_effort"] = effort
        out.setdefault("enable_thinking", effort != "none")
    return out or None


def asks_thinking(body: dict[str, Any]) -> str | None:
    """The parameter that asks for thinking (an effort other than none, a thinking kwarg
    set true), or None."""
    if body.get("reasoning_effort") not in (None, "none"):
        return "reasoning_effort"
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict):
        for name in THINKING_KWARGS:
            if kwargs.get(name) is True:
                return f"chat_template_kwargs.{name}"
    return None


@dataclass(frozen=True)
class Reasoning:
    """The deployment's reasoning parser (None: the engines run none)."""

    parser: str | None = None

    @property
    def on(self) -> bool:
        return self.parser is not None

    def chat_engine(self, kind: str) -> bool:
        """Whether a turn of `kind` runs on the engine's chat endpoint for its parser."""
        return self.on and kind == "chat"

    def rebases(self, rule: str, history: Messages, new: Messages) -> bool:
        """Whether a chat turn may re-base its session (`rebased`): under `template`, on a
        deployment whose engines parse thinking, when the turn closes the open one."""
        return self.on and rule == "template" and closes_turn(history, new)

    def check(self, body: dict[str, Any]) -> None:
        """A chat request's reasoning fields: a known effort, kwargs that are an object,
        and thinking asked only of a deployment that parses it (else it would come back
        inside `content`)."""
        effort = body.get("reasoning_effort")
        if effort is not None and effort not in EFFORTS:
            raise InvalidRequest(
                f"reasoning_effort must be one of {', '.join(EFFORTS)}, not {effort!r}",
                param="reasoning_effort",
            )
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise InvalidRequest(
                "chat_template_kwargs must be an object", param="chat_template_kwargs"
            )
        if body.get("include_reasoning") not in (None, True, False):
            raise InvalidRequest("include_reasoning must be a boolean", param="include_reasoning")
        if not self.on and (param := asks_thinking(body)) is not None:
            raise InvalidRequest(
                "thinking was asked for, but this deployment runs no reasoning parser "
                "(CTX_GATEWAY_REASONING_PARSER, docs/reasoning.md): its thinking would "
                "come back inside content",
                param=param,
            )

    def check_raw(self, raw: bytes, body: dict[str, Any]) -> None:
        """`check` for a request passed through as it is, read only if its bytes name a
        reasoning field (the usual request costs a byte search)."""
        if b"reasoning_effort" in raw or b"chat_template_kwargs" in raw:
            self.check(body)


def check_rule(rule: Any) -> Rule:
    if rule not in RULES:
        raise InvalidRequest(
            f"reasoning_history must be one of {', '.join(RULES)}, not {rule!r}",
            param="reasoning_history",
        )
    return rule  # type: ignore[no-any-return]


def closes_turn(history: Messages, new: Messages) -> bool:
    """Whether a turn's new messages close the open user turn: the session has an answer
    and a user message comes after it (a tool result continues the turn's chain)."""
    return bool(history) and any(m.get("role") == "user" for m in new)


def rebased(stored: list[int], full: list[int]) -> list[int] | None:
    """Under `template`, on a turn that closes the open one: the conversation's rendering
    (`full`) to replace the stored ids with, if they are not a prefix of it (the template
    dropped the closed turn's reasoning); None: append as usual."""
    if not stored or full[: len(stored)] == stored:
        return None
    return full
