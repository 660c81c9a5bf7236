"""Server-sent events as OpenAI and vLLM stream them: `data: {...}\n\n`, then `data: [DONE]`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from pydantic import BaseModel
from starlette.responses import StreamingResponse

from ctxcache.errors import CtxError

DONE = "data: [DONE]\n\n"


def event(payload: BaseModel | dict[str, Any]) -> str:
    data = payload.model_dump(exclude_none=False) if isinstance(payload, BaseModel) else payload
    return f"data: {orjson.dumps(data).decode()}\n\n"


def stream(chunks: AsyncIterator[str]) -> StreamingResponse:
    """A text/event-stream response; an error after the first byte becomes an error event."""

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except CtxError as exc:
            yield event(exc.envelope())
        yield DONE

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"cache-control": "no-cache"}
    )
