"""A turn's whole answer in the shape of the route it came to (without its session)."""

from __future__ import annotations

from typing import Any

from gateway.shaping import ChunkShaper, chat_completion, text_completion
from gateway.turn_engine import Generation
from gateway.turn_planning import Turn


def shape(
    turn: Turn, gen: Generation, body: dict[str, Any], shaper: ChunkShaper | None = None
) -> dict[str, Any]:
    """The answer without its session (`with_session` adds it); a stream's carries the
    stream's id and time, so a replay of it is the same stream."""
    if turn.kind == "chat":
        out = chat_completion(
            turn.model, gen.text, gen.finish_reason, gen.usage, gen.message, gen.logprobs
        )
    else:
        ids = gen.token_ids if body.get("return_token_ids") else None
        out = text_completion(turn.model, gen.text, gen.finish_reason, gen.usage, ids)
    if shaper is not None:
        out.update(id=shaper.id, created=shaper.created)
    return out
