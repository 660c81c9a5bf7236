"""Session pins: which sessions' blocks must not be evicted, and until when.

A session is pinned from `PUT /sessions/{key}` until its `expires_at`; the store asks
this table whether a block's session is pinned. Pins are saved to `sessions.json` in the
data directory (written atomically, by the reaper, when they changed) so a restarted
sidecar keeps protecting the KV it reloads from disk.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)


class PinTable:
    """session key -> expires_at (unix seconds). Not thread-safe: the store's lock guards it."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._pins: dict[str, float] = {}
        self.dirty = False
        if path is not None and path.exists():
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            raw = json.loads(path.read_text())
            now = time.time()
            self._pins = {str(k): float(v) for k, v in raw.items() if float(v) > now}
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("ignoring unreadable %s: %s", path, exc)

    def is_pinned(self, session: str | None, now: float | None = None) -> bool:
        if session is None:
            return False
        exp = self._pins.get(session)
        return exp is not None and exp > (time.time() if now is None else now)

    def expires_at(self, session: str) -> float | None:
        return self._pins.get(session)

    def set(self, session: str, expires_at: float) -> bool:
        """Pin or extend; returns True if the session was not pinned before."""
        was = session in self._pins
        self._pins[session] = expires_at
        self.dirty = True
        return not was

    def remove(self, session: str) -> None:
        if self._pins.pop(session, None) is not None:
            self.dirty = True

    def expired(self, now: float) -> list[str]:
        return [s for s, exp in self._pins.items() if exp <= now]

    def __len__(self) -> int:
        return len(self._pins)

    def snapshot(self) -> dict[str, float]:
        self.dirty = False
        return dict(self._pins)


def save_pins(path: Path, pins: dict[str, float]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(pins, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
