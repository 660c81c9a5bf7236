"""Reading a client's JSON body once: parsed, validated, and kept raw for pass-through."""

from __future__ import annotations

from typing import Any, TypeVar

import orjson
from fastapi import Request
from pydantic import BaseModel, ValidationError

from ctxcache.errors import InvalidRequest, validation_error

M = TypeVar("M", bound=BaseModel)


async def read_json(request: Request, model: type[M]) -> tuple[bytes, dict[str, Any], M]:
    raw = await request.body()
    body, parsed = parse_json(raw, model)
    return raw, body, parsed


def parse_json(
    raw: bytes, model: type[M], parsed: dict[str, Any] | None = None
) -> tuple[dict[str, Any], M]:
    """A body as a dict and validated as `model`; `invalid_request` (or `invalid_ttl`).
    `parsed` is `raw` already decoded, when a caller has done that."""
    try:
        body = parsed if parsed is not None else orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        validated = model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    return body, validated


def parse_body(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object, or None (the full validation then says what is wrong)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


def session_id_of(body: dict[str, Any], in_header: str | None) -> str | None:
    """`session_id` in the body (the openai SDK's extra_body) or the X-Session-Id header."""
    in_body = body.get("session_id")
    if in_body is not None and in_header is not None and in_body != in_header:
        raise InvalidRequest("session_id in the body and X-Session-Id differ", param="session_id")
    sid = in_body if in_body is not None else in_header
    if sid is not None and not isinstance(sid, str):
        raise InvalidRequest("session_id must be a string", param="session_id")
    return sid


# `stream: true` answers server-sent events, each `data:` a chunk object, then `[DONE]`
STREAMS: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {}}}}


def body_doc(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` naming the body schema of a route that reads its raw body itself
    (the schema is added to the document by `gateway.app`)."""
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
            },
        }
    }
