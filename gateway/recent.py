"""The chat histories of sessions this gateway served last, for rendering a turn early.

A chat turn's prompt is rendered from the session's stored messages, which the manager
loads at the start of the turn. When this gateway process ran the session's previous
turn, it already knows those messages, and the version they belong to: the turn renders
from them while the manager loads the session, and uses that rendering only if the
loaded version is the same one (every append bumps it, so equal versions mean equal
messages). Anything else — another gateway replica ran the last turn, the entry was
evicted — costs nothing but the usual order of calls.

Bounded by sessions and by characters of content; `drop` forgets a deleted session.
Nothing here is ever served: it only feeds `/tokenize` calls for the same session.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

Messages = list[dict[str, Any]]


def _chars(messages: Messages) -> int:
    return sum(64 + len(str(m.get("content") or "")) for m in messages)


class RecentHistories:
    def __init__(self, *, max_sessions: int = 1024, max_chars: int = 32 << 20) -> None:
        self.max_sessions = max_sessions
        self.max_chars = max_chars
        self._entries: OrderedDict[str, tuple[int, Messages, int]] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_id: str) -> tuple[int, Messages] | None:
        """(version, messages) as of this gateway's last turn of the session."""
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        self._entries.move_to_end(session_id)
        return entry[0], entry[1]

    def put(self, session_id: str, version: int, messages: Messages) -> None:
        self.drop(session_id)
        self._store(session_id, version, messages, _chars(messages))

    def _store(self, session_id: str, version: int, messages: Messages, size: int) -> None:
        if size > self.max_chars:
            return
        self._entries[session_id] = (version, messages, size)
        self._chars += size
        while len(self._entries) > self.max_sessions or self._chars > self.max_chars:
            _, (_, _, evicted) = self._entries.popitem(last=False)
            self._chars -= evicted

    def advance(self, session_id: str, version: int, added: Messages, *, after: int) -> bool:
        """The session went from version `after` to `version` by appending `added`:
        remember the new history without measuring the old part again. False (nothing
        changed) if the entry is not at `after`."""
        entry = self._entries.get(session_id)
        if entry is None or entry[0] != after:
            return False
        _, previous, size = entry
        self.drop(session_id)
        self._store(session_id, version, previous + added, size + _chars(added))
        return True

    def drop(self, session_id: str) -> None:
        entry = self._entries.pop(session_id, None)
        if entry is not None:
            self._chars -= entry[2]
