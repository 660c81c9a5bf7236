"""The real vLLM (CPU) serving a sliding-window model with the connector: `tiny-sliding`,
whose layers alternate a 256-token window and full attention, and `tiny-gemma3` (Gemma 3's
5:1 of 512-token windows and full attention: six groups). vLLM keeps its hybrid KV
cache manager on (two KV cache groups), and a session's turn after vLLM's prefix cache is
reset reuses its history from the sidecar — every block of the full-attention layers, the
last window of the windowed ones — and answers as the whole conversation sent without a
session does, in float32. (The plans, unit level: test_groups.py.)"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from ctxcache.lmcache_keys import session_key
from ctxcache.redis_server import RedisServer
from sidecar.client import KVClient
from sidecar.protocol import DTYPE_FLOAT32, FMT_KV_2LTD
from tests.vllm_connector.conftest import VLLM_TIMEOUT, VllmStack, started_stack
from tests.vllm_connector.test_vllm_e2e import BLOCK, Chat, cached, vllm_counter, wait_for

log = logging.getLogger(__name__)

pytestmark = [
    pytest.mark.timeout(VLLM_TIMEOUT),
    pytest.mark.slow,  # an engine start of its own (a model of its own, float32)
]


# preset: what the connector's start-up line says of its groups
GROUPS = {
    "tiny-sliding": ("2 KV cache groups served", "sliding window 256"),
    "tiny-gemma3": ("6 KV cache groups served", "sliding window 512"),
}


@pytest.fixture(scope="module", params=list(GROUPS))
def sliding_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.presets import create_model

    return create_model(request.param, tmp_path_factory.mktemp("models") / request.param)


@pytest.fixture(scope="module")
def sliding_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, sliding_model: Path
) -> Iterator[VllmStack]:
    with started_stack(tmp_path_factory, redis_server, sliding_model, dtype="float32") as stack:
        yield stack


def vllm_log(stack: VllmStack) -> str:
    path = stack.vllm.log_path
    assert path is not None
    return path.read_text(errors="replace")


def test_vllm_keeps_its_hybrid_kv_cache_manager_on(
    sliding_stack: VllmStack, sliding_model: Path
) -> None:
    log = vllm_log(sliding_stack)
    groups, window = GROUPS[sliding_model.name]
    assert "Turning off hybrid kv cache manager" not in log
    assert f"hybrid KV cache manager on; {groups}" in log
    assert window in log
    assert "is not supported" not in log


def test_after_a_prefix_cache_reset_the_sidecar_serves_both_groups(
    sliding_stack: VllmStack,
) -> None:
    chat = Chat(sliding_stack, seed=11)
    chat.turn("what is the cat doing?")
    loaded_before = vllm_counter(sliding_stack, "loaded_tokens")
    for question in ("and the dogs?", "will it rain?", "who talked?"):
        sliding_stack.reset_prefix_cache()  # vLLM forgets; only the sidecar has the KV
        context = chat.context_tokens()
        _, usage = chat.turn(question)  # also checks the text against the full history
        log.info("turn after a reset: %d of %d history tokens reused", cached(usage), context)
        assert context - BLOCK <= cached(usage) <= context
    wait_for(lambda: vllm_counter(sliding_stack, "loaded_tokens") > loaded_before)
    held = chat.info()
    assert held["kv_bytes"] > 0


def test_a_corrupt_window_fails_the_whole_load_and_is_recomputed(
    sliding_stack: VllmStack, sliding_model: Path
) -> None:
    """Only the windowed group's blocks are wrong: the full group's load goes through, the
    request's load is reported failed (vLLM's `failed_recving`: block ids repeat across
    groups, so no block can be named) and vLLM recomputes it — the same answer as the
    whole conversation, never a failed step. (`tiny-sliding`: its group 0 is the window.)"""
    if sliding_model.name != "tiny-sliding":
        pytest.skip("its windowed group's keys are named for tiny-sliding's groups")
    assert "group 0: sliding window 256" in vllm_log(sliding_stack)  # its keys: `tiny#g0@...`
    chat = Chat(sliding_stack, seed=13)
    chat.turn("what is the cat doing?")
    tag = f"s%{session_key(chat.sid)}"
    with KVClient.from_url(sliding_stack.sidecar_lm) as kv:
        wait_for(lambda: any(k.endswith(tag) and "#g0@" in k for k in kv.list_keys()))
        windowed = [k for k in kv.list_keys() if k.endswith(tag) and "#g0@" in k]
        for key in windowed:  # same keys, wrong blocks: EXIST says yes, the load refuses them
            garbage = bytes(range(256)) * 64
            kv.put(key, garbage, fmt=FMT_KV_2LTD, dtype=DTYPE_FLOAT32, shape=(2, 2, 32, 64))
        kv.health()  # a round trip after the PUTs: the sidecar has them
    failures = vllm_counter(sliding_stack, "load_failures")
    sliding_stack.reset_prefix_cache()
    chat.turn("and the dogs?")  # answered exactly like the full history
    wait_for(lambda: vllm_counter(sliding_stack, "load_failures") > failures)
    assert "Traceback" not in vllm_log(sliding_stack)


def conversation(stack: VllmStack) -> dict[str, int]:
    """One conversation of four turns, each after a prefix-cache reset; what the sidecar
    holds for it at the end and what its turns reused."""
    chat = Chat(stack, seed=12)
    reused = 0
    for question in ("what is the cat doing?", "and the dogs?", "will it rain?", "who?"):
        stack.reset_prefix_cache()
        _, usage = chat.turn(question)
        reused += cached(usage)
    held = chat.info()
    return {"context": chat.context_tokens(), "reused": reused, "bytes": held["kv_bytes"]}


def test_windowed_layers_store_less_than_the_same_model_all_full(
    sliding_stack: VllmStack,
    sliding_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    redis_server: RedisServer,
) -> None:
    """The same conversation on the same model with vLLM's hybrid manager off (every
    layer then keeps, and the connector stores, every block): the windowed layers' share
    of the bytes shrinks to their window. (`tiny-sliding` only: a third engine start.)"""
    if sliding_model.name != "tiny-sliding":
        pytest.skip("measured on tiny-sliding (docs/vllm.md, 'Hybrid models')")
    hybrid = conversation(sliding_stack)
    with started_stack(
        tmp_path_factory,
        redis_server,
        sliding_model,
        dtype="float32",
        vllm_args=("--disable-hybrid-kv-cache-manager",),
    ) as stack:
        assert "hybrid KV cache manager on" not in vllm_log(stack)
        full = conversation(stack)
    log.info("bytes per conversation: hybrid %s, all full %s", hybrid, full)
    assert hybrid["context"] == full["context"]  # the same conversation
    assert hybrid["reused"] >= full["reused"] - 4 * BLOCK
    # half the layers full (all of the history), half windowed (a window and the turns since)
    assert hybrid["bytes"] < 0.8 * full["bytes"]
