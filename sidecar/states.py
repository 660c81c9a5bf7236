"""A session's recurrent-state blocks: the newest few kept, older ones dropped.

The vLLM connector stores, for a hybrid model (Mamba / gated-delta-net layers), one state
block per finished request (`vllm_connector/state_worker.py`: LMCache's `BINARY` format, a
key tagged `rs%<version>`). A session's next turn needs only its newest; an older one
serves only a fork or a retry from an earlier turn. A state block of a large model weighs
what thousands of tokens of KV do (Qwen3-Next-80B: about 75 MB), so a long conversation's
older ones would crowd out other sessions' KV: the store keeps each session's newest
`keep` and drops the older (0: keeps every one). The session's KV blocks are never touched.
"""

from __future__ import annotations

from collections import deque

from ctxcache.lmcache_keys import parse_key
from sidecar.blocks import BlockMeta
from sidecar.protocol import FMT_BINARY

STATE_TAG = "rs"


def is_state(meta: BlockMeta) -> bool:
    """Whether a block is the connector's recurrent-state block."""
    if meta.fmt != FMT_BINARY or meta.session is None:
        return False
    try:
        return any(name == STATE_TAG for name, _ in parse_key(meta.key).tags)
    except ValueError:
        return False


class StateBlocks:
    """Per session, the keys of its state blocks, oldest first (under the store's lock)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._keys: dict[str, deque[str]] = {}

    def added(self, meta: BlockMeta) -> list[str]:
        """Record a stored block; the keys of the session's state blocks now to drop."""
        if self.keep <= 0 or not is_state(meta):
            return []
        assert meta.session is not None
        keys = self._keys.setdefault(meta.session, deque())
        if meta.key in keys:
            keys.remove(meta.key)  # (stored again: the newest now)
        keys.append(meta.key)
        return [keys.popleft() for _ in range(len(keys) - self.keep)]

    def forget(self, session: str) -> None:
        self._keys.pop(session, None)
