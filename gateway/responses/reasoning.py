"""Reasoning in the Responses API (docs/responses.md, "Reasoning"): the `reasoning` output
item of an answer the engine's reasoning parser split (`Generation.message["reasoning"]`),
its token count, the request's `reasoning` settings, and the reasoning items a client sends
back as input.

A reasoning item's id names the response that made it: `rs_` + the response id's body
(its session and its field, `gateway.responses.protocol`). A reasoning item sent back is
accepted only as what it was: the stored response it names (this tenant's) has it, with the
same text, and the items that follow it in the input are that response's own answer (its
message and function calls). It then becomes that assistant message's `reasoning`. Anything
else is a 400 naming the item, checked before the turn is planned: a refused request loads,
locks and changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from cache_manager.client import ManagerClient
from ctxcache.errors import CtxError, InvalidRequest, SessionNotFound
from gateway.pool import Worker
from gateway.prompts import PromptBuilder
from gateway.reasoning import Reasoning
from gateway.resent import canonical
from gateway.responses.items import messages_of
from gateway.responses.protocol import (
    RESPONSE_PREFIX,
    ReasoningItem,
    ReasoningText,
    ResponseCreate,
    parse_response_id,
)
from gateway.upstream import WorkerDown

log = logging.getLogger(__name__)

REASONING_PREFIX = "rs_"
ENCRYPTED = "reasoning.encrypted_content"


def reasoning_id(response_id: str) -> str:
    return REASONING_PREFIX + response_id.removeprefix(RESPONSE_PREFIX)


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """OpenAI's `ResponseReasoningItem`: the text as one `reasoning_text` part, no summary."""
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def reasoning_of(message: dict[str, Any] | None) -> str | None:
    """The reasoning of an engine's answer (vLLM's `reasoning`; None: none, or empty)."""
    text = (message or {}).get("reasoning")
    return text if isinstance(text, str) and text else None


def check_reasoning_fields(req: ResponseCreate, parser: Reasoning) -> None:
    """Refuse, before anything is loaded, what is not supported (encrypted reasoning, in
    either direction), an unknown effort, and thinking asked of a deployment whose engines
    parse none (`parser`, the chat turns' check: `gateway.reasoning`)."""
    if req.include and ENCRYPTED in req.include:
        raise InvalidRequest(
            f"include {ENCRYPTED!r} is not supported: ctxcache keeps reasoning on the server "
            "(continue with previous_response_id or conversation, or send the reasoning "
            "items back as they were output)",
            param="include",
        )
    for i, item in enumerate(req.input if isinstance(req.input, list) else ()):
        if isinstance(item, ReasoningItem) and item.encrypted_content is not None:
            raise InvalidRequest(
                "encrypted_content is not supported: send the reasoning item as it was "
                "output (its id and content)",
                param=f"input[{i}].encrypted_content",
            )
    try:
        parser.check(reasoning_fields(req))
    except InvalidRequest as exc:  # (the chat turn's name for it)
        exc.message = exc.message.replace("reasoning_effort", "reasoning.effort")
        exc.param = "reasoning.effort"
        raise


def reasoning_fields(req: ResponseCreate) -> dict[str, Any]:
    """The request's `reasoning` as the chat turn takes it: `reasoning_effort`, which
    reaches the chat template (docs/reasoning.md)."""
    effort = req.reasoning.effort if req.reasoning is not None else None
    return {"reasoning_effort": effort} if effort is not None else {}


def reasoning_echo(req: ResponseCreate) -> dict[str, Any]:
    """The response object's `reasoning`: the request's effort and summary setting."""
    r = req.reasoning
    return {
        "effort": r.effort if r is not None else None,
        "summary": (r.summary or r.generate_summary) if r is not None else None,
    }


def not_found(item_id: str, i: int) -> InvalidRequest:
    """OpenAI's answer to a reasoning item it does not hold."""
    return InvalidRequest(
        f"Item with id '{item_id}' not found. Items are not persisted when `store` is set to "
        "false: continue with previous_response_id, or remove this item from your input.",
        param=f"input[{i}]",
    )


async def check_reasoning_input(manager: ManagerClient, tenant: str, req: ResponseCreate) -> None:
    """Check each reasoning item of the input against the stored response it names (one
    read per response, all at once), and fill in its text where the client left it out."""
    if not isinstance(req.input, list):
        return
    named: dict[int, tuple[str, str]] = {}  # input index -> (session, field)
    for i, item in enumerate(req.input):
        if isinstance(item, ReasoningItem):
            parsed = parse_response_id(RESPONSE_PREFIX + item.id.removeprefix(REASONING_PREFIX))
            if not item.id.startswith(REASONING_PREFIX) or parsed is None:
                raise not_found(item.id, i)
            named[i] = parsed
    if not named:
        return
    where = list(dict.fromkeys(named.values()))
    found = await asyncio.gather(*(_stored(manager, tenant, *w) for w in where))
    records = dict(zip(where, found, strict=True))
    items = [i.model_dump(exclude_none=True) for i in req.input]
    for i, parsed in named.items():
        item = req.input[i]
        assert isinstance(item, ReasoningItem)
        output = (records[parsed] or {}).get("output") or []
        stored = next((o for o in output if o.get("id") == item.id), None)
        if stored is None:
            raise not_found(item.id, i)
        text = "".join(p.get("text") or "" for p in stored.get("content") or ())
        if item.text is not None and item.text != text:
            raise InvalidRequest(
                f"reasoning item {item.id!r} does not match the reasoning the model generated",
                param=f"input[{i}].content",
            )
        answer = [o for o in output if o.get("type") != "reasoning"]
        if not _same(_following(items, i), answer):
            raise InvalidRequest(
                f"reasoning item {item.id!r} must be followed by the output it was generated "
                "with (that response's message and function calls, in order)",
                param=f"input[{i}]",
            )
        item.content = [ReasoningText(type="reasoning_text", text=text)]


async def _stored(
    manager: ManagerClient, tenant: str, session_id: str, field: str
) -> dict[str, Any] | None:
    """The stored response object (None: not this tenant's, or gone)."""
    try:
        found = await manager.get_response(session_id, tenant, field)
    except SessionNotFound:
        return None
    return found.record.get("response")  # type: ignore[no-any-return]


def _following(items: list[dict[str, Any]], i: int) -> list[dict[str, Any]]:
    """The assistant's items right after item `i`: its messages and function calls."""
    out = []
    for item in items[i + 1 :]:
        kind = item.get("type", "message")
        if kind == "function_call" or (kind == "message" and item.get("role") == "assistant"):
            out.append(item)
        else:
            break
    return out


def _same(sent: list[dict[str, Any]], answer: list[dict[str, Any]]) -> bool:
    """Whether the items sent are the answer's (as messages, in canonical form: what a
    client's echo keeps the same, `gateway.resent`)."""
    a, b = messages_of(sent), messages_of(answer)
    return len(a) == len(b) and all(canonical(x) == canonical(y) for x, y in zip(a, b, strict=True))


async def reasoning_tokens(
    prompts: PromptBuilder,
    worker: Worker | None,
    model: str,
    usage: dict[str, Any],
    reasoning: str | None,
) -> int:
    """`output_tokens_details.reasoning_tokens`: the engine's count when it gives one
    (vLLM with a reasoning parser counts the generated ids inside the reasoning markers),
    else the tokens of the reasoning text (its own tokenization on the worker that ran the
    turn; the markers around it not counted). Never more than the output tokens."""
    details = usage.get("completion_tokens_details") or {}
    counted = int(details.get("reasoning_tokens") or 0)
    if counted <= 0 and reasoning and worker is not None:
        try:
            ids, _ = await prompts.text(worker, model, reasoning, special=False)
            counted = len(ids)
        except (CtxError, WorkerDown) as exc:  # (the answer stands; only the count is lost)
            log.warning("could not count the reasoning tokens: %s", exc)
    return min(counted, int(usage.get("completion_tokens") or 0))
