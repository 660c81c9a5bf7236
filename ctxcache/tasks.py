"""Work that runs after answering: kept referenced, failures logged, drained at shutdown."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from ctxcache.logs import bind_session


class BackgroundTasks:
    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(
        self, work: Coroutine[Any, Any, Any], *, what: str, session_id: str = "-"
    ) -> asyncio.Task[None]:
        """Run `work` in the background; a failure is logged as `what failed: ...`."""

        async def run() -> None:
            with bind_session(session_id):
                try:
                    await work
                except Exception as exc:  # background work never fails a request
                    self.log.warning("%s failed: %s: %s", what, type(exc).__name__, exc)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain(self) -> None:
        """Wait until nothing is left running (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
