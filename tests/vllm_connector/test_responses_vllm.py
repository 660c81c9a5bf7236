"""The Responses API over the real vLLM engine: a `previous_response_id` chain answers as
the same conversation sent in full, and reuses the chain's KV (on the run's shared default
stack; the lm:// path on the real vLLM: test_vllm_tcp.py)."""

from __future__ import annotations

import openai
import pytest

from tests.vllm_connector.conftest import VLLM_TIMEOUT, VllmStack, document
from tests.vllm_connector.test_vllm_e2e import (
    BLOCK,
)

pytestmark = pytest.mark.timeout(VLLM_TIMEOUT)


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
            want = client.responses.create(  # (passed through: not an implicit session's)
                input=history,  # type: ignore[arg-type]
                instructions=instructions,
                store=False,
                extra_body={"prompt_cache_options": {"mode": "explicit"}},
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
