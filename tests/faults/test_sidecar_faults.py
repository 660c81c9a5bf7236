"""The KV sidecar killed, stalled, or serving a corrupt block: turns still succeed, exactly.

Losing KV may cost speed, never a failed turn or a different answer: every turn here is
checked against the same conversation recomputed in full.
"""

from __future__ import annotations

import logging
import time

import httpx

from ctxcache.lmcache_keys import session_key
from tests.faults.conftest import (
    CHUNK,
    SIDECAR_TIMEOUT_S,
    Conversation,
    FaultStack,
    stopped,
    wait_for,
)
from tests.faults.conftest import usage_cached as cached

log = logging.getLogger(__name__)


def stored_blocks(stack: FaultStack, session_id: str) -> int:
    r = httpx.get(f"{stack.sidecar_url}/sessions/{session_key(session_id)}", timeout=10)
    r.raise_for_status()
    return int(r.json()["blocks"])


def wait_stored(stack: FaultStack, session_id: str) -> int:
    """Wait until the session's blocks have reached the sidecar (PUTs are asynchronous)."""
    seen: list[int] = []

    def settled() -> bool:
        seen.append(stored_blocks(stack, session_id))
        return len(seen) >= 5 and seen[-1] > 0 and len(set(seen[-5:])) == 1

    wait_for(settled, 30, "the session's blocks in the sidecar")
    return seen[-1]


def recovered(conv: Conversation, at_least: int, timeout: float = 60) -> dict:  # type: ignore[type-arg]
    """Read-only turns (nothing appended) until the sidecar serves KV again."""
    deadline = time.monotonic() + timeout
    while True:
        got = conv.turn("Are you back?", append=False)
        if cached(got) >= at_least or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def test_sidecar_sigkill_mid_conversation_then_restart(fstack: FaultStack) -> None:
    with fstack.client() as http:
        conv = Conversation(http)
        wait_stored(fstack, conv.session_id)
        assert cached(conv.turn("What stays on the server?")) >= CHUNK  # from the sidecar
        wait_stored(fstack, conv.session_id)
        on_disk = len(list(fstack.blocks_dir.glob("*.kv")))
        assert on_disk > 0
        before_kill = conv.info()["context_tokens"]

        assert fstack.sidecar is not None
        fstack.sidecar.kill()  # SIGKILL: no flush, no goodbye
        for q in ("And now?", "Still there?"):
            got = conv.turn(q)  # succeeds, recomputed (L1 is off in this stack)
            assert cached(got) == 0
        assert len(list(fstack.blocks_dir.glob("*.kv"))) == on_disk  # nothing lost on disk

        fstack.start_sidecar()  # same ports, same data dir
        # the blocks written before the kill serve the prefix again, without any restart
        # of the workers or the gateway (their circuit breakers close by themselves)
        got = recovered(conv, at_least=(before_kill - 1) // CHUNK * CHUNK)
        assert cached(got) >= (before_kill - 1) // CHUNK * CHUNK > 0
        assert conv.info()["turns"] == 4  # create + 3 turns, none lost
    fstack.wait_sidecar_serving()


def test_corrupt_block_on_disk_is_a_miss_with_the_right_answer(fstack: FaultStack) -> None:
    fstack.wait_sidecar_serving()
    with fstack.client() as http:
        conv = Conversation(http)
        wait_stored(fstack, conv.session_id)
        conv.turn("Which clause matters?")
        wait_stored(fstack, conv.session_id)
        assert cached(recovered(conv, at_least=CHUNK)) >= CHUNK  # KV served from disk
        files = list(fstack.blocks_dir.glob("*.kv"))
        assert files
        for f in files:  # flip one payload byte in every block file, sidecar running
            with open(f, "r+b") as fh:
                size = fh.seek(0, 2)
                fh.seek(size // 2)
                byte = fh.read(1)
                fh.seek(size // 2)
                fh.write(bytes([byte[0] ^ 0x5A]))
        got = conv.turn("Is the document intact?")
        assert cached(got) == 0  # the first chunk is corrupt: nothing reused, all recomputed
        metrics = httpx.get(f"{fstack.sidecar_url}/metrics", timeout=10).text
        corrupt = [
            ln
            for ln in metrics.splitlines()
            if ln.startswith("ctxcache_sidecar_corrupt_blocks_total")
        ]
        assert corrupt and float(corrupt[0].split()[-1]) >= 1
        # the recomputed turn stored fresh blocks: the next turn reuses KV again
        wait_stored(fstack, conv.session_id)
        assert cached(conv.turn("And the next one?")) >= CHUNK


def test_stalled_sidecar_costs_a_bounded_delay_never_a_failure(fstack: FaultStack) -> None:
    assert fstack.sidecar is not None
    fstack.wait_sidecar_serving()
    with fstack.client() as http:
        conv = Conversation(http)
        wait_stored(fstack, conv.session_id)
        t0 = time.monotonic()
        assert cached(conv.turn("Warm turn?")) >= CHUNK
        warm_s = time.monotonic() - t0
        with stopped(fstack.sidecar):  # SIGSTOP: connections hang, nothing answers
            with fstack.client(timeout=30) as bounded:  # a hang fails here
                stalled = Conversation.__new__(Conversation)
                stalled.__dict__.update(conv.__dict__, http=bounded)
                t0 = time.monotonic()
                got = stalled.turn("Is anyone there?")
                stalled_s = time.monotonic() - t0
                assert cached(got) == 0
                got = stalled.turn("Still stalled?")  # the breaker skips the sidecar now
                # the session's admin calls pin/drop KV in the background: never blocked
                r = bounded.patch(f"/v1/context/{conv.session_id}", json={"ttl": 900})
                assert r.status_code == 200, r.text
            conv.history = stalled.history
        log.info(
            "stalled sidecar: turn + reference %.2f s (warm %.2f s), sidecar timeout %.1f s",
            stalled_s,
            warm_s,
            SIDECAR_TIMEOUT_S,
        )
        recovered(conv, at_least=CHUNK)
        assert conv.info()["turns"] == 4
    fstack.wait_sidecar_serving()
