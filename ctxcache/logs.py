"""Logging setup: one line per record, the component name and the session id in it.

Code that works on a session sets `session_var` (or uses `bind_session`), and every
record logged in that context carries `session=<id>` without being passed it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from contextvars import ContextVar

session_var: ContextVar[str] = ContextVar("session_id", default="-")


class _SessionFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "session_id"):
            record.session_id = session_var.get()
        return True


@contextlib.contextmanager
def bind_session(session_id: str) -> Iterator[None]:
    token = session_var.set(session_id)
    try:
        yield
    finally:
        session_var.reset(token)


def setup_logging(component: str, level: str | None = None) -> None:
    """Configure the root logger once per process; safe to call again."""
    level = (level or os.environ.get("CTX_LOG_LEVEL") or "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_SessionFilter())
    handler.setFormatter(
        logging.Formatter(
            f"%(asctime)s %(levelname)-5s [{component}] %(name)s session=%(session_id)s %(message)s"
        )
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for noisy in ("httpx", "httpcore", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
