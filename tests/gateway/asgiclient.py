"""The client's side of an ASGI response, as uvicorn shows it to the app."""

from __future__ import annotations

import asyncio

from starlette.types import Message


class Client:
    """Records what the app sends; `receive` answers `http.disconnect` once the client
    leaves (after `leave_after` messages, if given) or once the answer is complete."""

    def __init__(self, leave_after: int | None = None) -> None:
        self.sent: list[Message] = []
        self.leave_after = leave_after
        self._gone = asyncio.Event()

    async def receive(self) -> Message:
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)
        if not message.get("more_body", True) or len(self.sent) == self.leave_after:
            self._gone.set()
