"""Redis failures as the store's one error: unreachable, failing over or refusing the
command -> `StoreUnavailable` (503 `store_unavailable`), never a 500."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator

from redis import exceptions as rexc

from ctxcache.errors import StoreUnavailable

# Redis down, restarting, loading its AOF, or a master failing over: a replica that was a
# master answers READONLY, a cluster CLUSTERDOWN / TRYAGAIN or with a slot nobody serves.
_UNAVAILABLE = (
    rexc.ConnectionError,  # also Sentinel's MasterNotFoundError, and BusyLoadingError
    rexc.TimeoutError,
    rexc.ReadOnlyError,
    rexc.ClusterError,  # also ClusterDownError, MasterDownError, "TTL exhausted"
    rexc.TryAgainError,
    rexc.SlotNotCoveredError,
    OSError,
)


def _unavailable(exc: BaseException) -> bool:
    if isinstance(exc, _UNAVAILABLE):
        return True
    if isinstance(exc, RuntimeError) and "the handler is closed" in str(exc):
        # uvloop's answer to a write on a connection a killed node had just closed (seen
        # when redis-py reconnected to a cluster master killed mid-run)
        return True
    # the cluster client found none of its nodes reachable
    return isinstance(exc, rexc.RedisClusterException) and isinstance(exc.__cause__, _UNAVAILABLE)


# Redis refusing a command it would run another time: memory full under `noeviction` (OOM),
# a failed RDB save with stop-writes-on-bgsave-error (MISCONF), another client's script past
# the busy threshold (BUSY), an ACL user without the right (NOPERM), a demoted master
# (READONLY), too few replicas for min-replicas-to-write (NOREPLICAS), a replica cut off from
# its master (MASTERDOWN). A command of a script gets the same refusal; Redis before 7 wraps
# it ("Error running script (...): @user_script:12: -OOM command not allowed ...") and words
# an ACL refusal inside a script without its code.
_REFUSALS = frozenset(
    ("OOM", "MISCONF", "BUSY", "NOPERM", "READONLY", "NOREPLICAS", "MASTERDOWN", "LOADING")
)
_IN_SCRIPT = re.compile(r": -([A-Z]+) ")
_REFUSAL_CLASSES = {
    rexc.OutOfMemoryError: "OOM",
    rexc.NoPermissionError: "NOPERM",
    rexc.ReadOnlyError: "READONLY",
}


def _refusal(exc: BaseException) -> str | None:
    """The code of a command Redis refused (see `_REFUSALS`), or None."""
    for cls, code in _REFUSAL_CLASSES.items():
        if isinstance(exc, cls):
            return code
    if not isinstance(exc, rexc.ResponseError):
        return None
    text = str(exc)
    first = text.split(" ", 1)[0]
    if first in _REFUSALS:
        return first
    if text.startswith("Error running script"):
        found = _IN_SCRIPT.search(text)
        if found is not None and found.group(1) in _REFUSALS:
            return found.group(1)
        if "The user executing the script can't run this command" in text:
            return "NOPERM"
    return None


@contextlib.asynccontextmanager
async def redis_errors() -> AsyncIterator[None]:
    """Redis unreachable, failing over or refusing the command -> `store_unavailable`
    (503, naming the refusal), never a 500."""
    try:
        yield
    except Exception as exc:
        if _unavailable(exc):
            raise StoreUnavailable(f"session store unavailable: {type(exc).__name__}") from exc
        code = _refusal(exc)
        if code is not None:
            raise StoreUnavailable(f"session store refused the command: {code}") from exc
        raise
