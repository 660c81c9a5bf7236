"""The same vLLM stack with `async_loads`: a session's KV loads on the connector's loader
thread while vLLM steps on (the request waits in WAITING_FOR_REMOTE_KVS), and every answer
is still the full history's. The tests imported here run again on this module's stack."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ctxcache.redis_server import RedisServer
from tests.vllm_connector.conftest import VLLM_TIMEOUT, VllmStack, started_stack
from tests.vllm_connector.test_vllm_e2e import (  # noqa: F401 (collected again, async)
    Chat,
    test_a_corrupt_block_is_a_miss_not_a_wrong_answer,
    test_a_killed_sidecar_costs_speed_only,
    test_after_a_prefix_cache_reset_the_sidecar_serves_the_session,
    test_session_turns_reuse_and_answer_like_the_full_history,
    vllm_counter,
    wait_for,
)

# its own vLLM start, for a setting that is off by default: `make test-slow` (CI runs it)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(VLLM_TIMEOUT)]


@pytest.fixture(scope="module")
def vllm_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, tiny_model: Path
) -> Iterator[VllmStack]:
    config = {"async_loads": True}
    with started_stack(tmp_path_factory, redis_server, tiny_model, config) as stack:
        yield stack


def test_loads_run_beside_the_engine_not_in_its_step(vllm_stack: VllmStack) -> None:
    chat = Chat(vllm_stack, seed=11)
    chat.turn("what is the cat doing?")
    before = vllm_counter(vllm_stack, "async_loads"), vllm_counter(vllm_stack, "load_ms")
    loaded = vllm_counter(vllm_stack, "loaded_tokens")
    vllm_stack.reset_prefix_cache()
    chat.turn("and the dogs?")  # the same text as the full history (Chat checks it)
    wait_for(lambda: vllm_counter(vllm_stack, "loaded_tokens") > loaded)
    wait_for(lambda: vllm_counter(vllm_stack, "async_loads") > before[0])
    assert vllm_counter(vllm_stack, "load_ms") == before[1]  # no step waited for a load
