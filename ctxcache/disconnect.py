"""Work for an HTTP client that stops when the client goes away.

ASGI servers tell an app that its client left only through `receive` (an
`http.disconnect` message); nothing cancels the app's task. So a request whose answer
takes a while — a generation, a stream — runs its work here: one task watches `receive`,
and if the client disconnects first, the work is cancelled (and with it the worker's
request: its connection is closed, and the engine stops generating for nobody).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientLeft(Exception):
    """The client disconnected before the work was done (the work was cancelled)."""


async def until_the_client_leaves(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """Run `work` in this task, cancelled if the client disconnects meanwhile: its result,
    or `ClientLeft`. Call it once the request's body is read."""
    task = asyncio.current_task()
    assert task is not None
    running, left = True, False

    def on_leave(_: object) -> None:
        nonlocal left
        if running:  # (after the last byte, `receive` says disconnect too)
            left = True
            task.cancel()

    watch = asyncio.ensure_future(_disconnect(receive))
    watch.add_done_callback(on_leave)
    try:
        return await work
    except asyncio.CancelledError:
        if not left:
            raise
        task.uncancel()  # the client left: nobody is left to answer
        raise ClientLeft() from None
    finally:
        running = False
        watch.cancel()


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
