"""Implicit sessions: a request without a session that resends a conversation this gateway
answered is served as a turn of that conversation (docs/implicit.md)."""
