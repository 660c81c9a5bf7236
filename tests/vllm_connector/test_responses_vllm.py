"""The Responses API over the real vLLM engine: a `previous_response_id` chain answers as
the same conversation sent in full, and reuses the chain's KV. This module's stack moves KV
over lm:// only (the others use the local sidecar's shared memory), so the TCP path is
checked on the real vLLM too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from ctxcache.redis_server import RedisServer
from tests.vllm_connector.conftest import VLLM_TIMEOUT, VllmStack, document, started_stack
from tests.vllm_connector.test_vllm_e2e import (
    BLOCK,
    Chat,
    cached,
    vllm_counter,
    wait_for,
)

pytestmark = pytest.mark.timeout(VLLM_TIMEOUT)


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


GREEDY = {"model": "tiny", "max_output_tokens": 24, "temperature": 0}


def test_three_turn_chain_equals_the_full_conversation(vllm_stack: VllmStack) -> None:
    client = openai.OpenAI(base_url=f"{vllm_stack.url}/v1", api_key="any", max_retries=0)
    instructions = document(seed=16)
    history: list[dict[str, str]] = []
    previous: str | None = None
    with client:
        for turn, question in enumerate(["Why?", "Where does it go?", "And then?"], start=1):
            got = client.responses.create(
                input=question, instructions=instructions, previous_response_id=previous, **GREEDY
            )
            history.append({"role": "user", "content": question})
            want = client.responses.create(
                input=history,  # type: ignore[arg-type]
                instructions=instructions,
                store=False,
                **GREEDY,
            )
            assert got.output_text == want.output_text, f"turn {turn} differs"
            usage = got.usage
            assert usage is not None and want.usage is not None
            assert usage.input_tokens == want.usage.input_tokens
            if turn > 1:  # all but less than one of vLLM's blocks comes from the cache
                cached = usage.input_tokens_details.cached_tokens
                assert cached >= usage.input_tokens - BLOCK, f"turn {turn}: {cached}"
            history.append({"role": "assistant", "content": got.output_text})
            previous = got.id
