"""The TCP path on the real vLLM: a stack whose connector moves KV over lm:// only (the
default stack uses the local sidecar's shared memory). Its own vLLM start for one test:
`make test-slow` (CI runs it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ctxcache.redis_server import RedisServer
from tests.vllm_connector.conftest import VLLM_TIMEOUT, VllmStack, started_stack
from tests.vllm_connector.test_vllm_e2e import BLOCK, Chat, cached, vllm_counter, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(VLLM_TIMEOUT)]


@pytest.fixture(scope="module")
def vllm_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, tiny_model: Path
) -> Iterator[VllmStack]:
    with started_stack(tmp_path_factory, redis_server, tiny_model, local=False) as stack:
        yield stack


def test_over_tcp_a_session_comes_back_from_the_sidecar(vllm_stack: VllmStack) -> None:
    chat = Chat(vllm_stack, seed=21)
    chat.turn("what is the cat doing?")
    # (counted from here: vLLM's metrics may carry other servers' counts in a shared
    # multiprocess directory)
    shm, tcp = (
        vllm_counter(vllm_stack, "load_bytes_shm"),
        vllm_counter(vllm_stack, "load_bytes_tcp"),
    )
    vllm_stack.reset_prefix_cache()
    context = chat.context_tokens()
    _, usage = chat.turn("and the dogs?")  # answered like the full history
    assert cached(usage) >= context - BLOCK
    wait_for(lambda: vllm_counter(vllm_stack, "load_bytes_tcp") > tcp)
    assert vllm_counter(vllm_stack, "load_bytes_shm") == shm
