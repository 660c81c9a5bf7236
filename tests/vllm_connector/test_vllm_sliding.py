"""The real vLLM (CPU) serving a sliding-window model with the connector: `tiny-sliding`,
whose layers alternate a 256-token window and full attention. vLLM keeps its hybrid KV
cache manager on (two KV cache groups), and a session's turn after vLLM's prefix cache is
reset reuses its history from the sidecar — every block of the full-attention layers, the
last window of the windowed ones — and answers as the whole conversation sent without a
session does, in float32. (The plans, unit level: test_groups.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ctxcache.redis_server import RedisServer
from tests.vllm_connector.conftest import VLLM_TIMEOUT, VllmStack, started_stack
from tests.vllm_connector.test_vllm_e2e import BLOCK, Chat, cached, vllm_counter, wait_for

pytestmark = [
    pytest.mark.timeout(VLLM_TIMEOUT),
    pytest.mark.slow,  # an engine start of its own (a model of its own, float32)
]


@pytest.fixture(scope="module")
def sliding_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[VllmStack]:
    from worker.presets import create_model

    model: Path = create_model("tiny-sliding", tmp_path_factory.mktemp("models") / "sliding")
    with started_stack(tmp_path_factory, redis_server, model, dtype="float32") as stack:
        yield stack


def vllm_log(stack: VllmStack) -> str:
    path = stack.vllm.log_path
    assert path is not None
    return path.read_text(errors="replace")


def test_vllm_keeps_its_hybrid_kv_cache_manager_on(sliding_stack: VllmStack) -> None:
    log = vllm_log(sliding_stack)
    assert "Turning off hybrid kv cache manager" not in log
    assert "hybrid KV cache manager on; 2 KV cache groups served" in log
    assert "sliding window 256" in log
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
        assert context - BLOCK <= cached(usage) <= context
    wait_for(lambda: vllm_counter(sliding_stack, "loaded_tokens") > loaded_before)
    held = chat.info()
    assert held["kv_bytes"] > 0
