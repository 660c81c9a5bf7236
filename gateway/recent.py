"""The chat histories of sessions this gateway served last, for rendering a turn early.

A chat turn's prompt is rendered from the session's stored messages, which the manager
loads at the start of the turn. When this gateway process ran the session's previous
turn, it already knows those messages, and the version they belong to: the turn renders
from them while the manager loads the session, and uses that rendering only if the
loaded version is the same one (every append bumps it, so equal versions mean equal
messages). Anything else — another gateway replica ran the last turn, the entry was
evicted — costs nothing but the usual order of calls.

Bounded by sessions and by characters of content; an entry is forgotten when its session
expires or is deleted through this gateway (`drop`). Nothing here is ever served: it only
feeds `/tokenize` calls for the same session. `CTX_GATEWAY_RECENT_CHAT_SESSIONS=0` keeps
nothing (every chat turn then tokenizes after the session is loaded).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, NamedTuple

Messages = list[dict[str, Any]]


def _chars(messages: Messages) -> int:
    return sum(64 + len(str(m.get("content") or "")) for m in messages)


class _Entry(NamedTuple):
    version: int
    messages: Messages
    chars: int
    expires_at: float  # the session's expiry, epoch seconds


class RecentHistories:
    def __init__(self, *, max_sessions: int = 1024, max_chars: int = 32 << 20) -> None:
        self.max_sessions = max_sessions
        self.max_chars = max_chars
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_id: str) -> tuple[int, Messages] | None:
        """(version, messages) as of this gateway's last turn of the session."""
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        if entry.expires_at <= time.time():
            self.drop(session_id)
            return None
        self._entries.move_to_end(session_id)
        return entry.version, entry.messages

    def put(self, session_id: str, version: int, messages: Messages, expires_at: float) -> None:
        self.drop(session_id)
        self._store(session_id, _Entry(version, messages, _chars(messages), expires_at))

    def advance(
        self, session_id: str, version: int, added: Messages, expires_at: float, *, after: int
    ) -> bool:
        """The session went from version `after` to `version` by appending `added`:
        remember the new history without measuring the old part again. False (nothing
        changed) if the entry is not at `after`."""
        entry = self._entries.get(session_id)
        if entry is None or entry.version != after:
            return False
        self.drop(session_id)
        chars = entry.chars + _chars(added)
        self._store(session_id, _Entry(version, entry.messages + added, chars, expires_at))
        return True

    def drop(self, session_id: str) -> None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._chars -= entry.chars

    def _store(self, session_id: str, entry: _Entry) -> None:
        if entry.chars > self.max_chars or self.max_sessions == 0:
            return
        self._entries[session_id] = entry
        self._chars += entry.chars
        now = time.time()
        while self._entries and (
            len(self._entries) > self.max_sessions
            or self._chars > self.max_chars
            or next(iter(self._entries.values())).expires_at <= now  # expired, oldest first
        ):
            _, evicted = self._entries.popitem(last=False)
            self._chars -= evicted.chars
