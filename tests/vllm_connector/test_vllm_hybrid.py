"""The real vLLM (CPU) serving a hybrid model with the connector: `tiny-hybrid`, a
Qwen3-Next whose layers alternate gated delta nets (recurrent state: vLLM's `MambaSpec`)
and full attention. vLLM keeps its hybrid KV cache manager on (two KV cache groups, the
state one in `mamba_cache_mode` "align"), and a session's turn after vLLM's prefix cache is
reset reuses its whole history from the sidecar: every full-attention block and the state
after the history's last token, so the turn prefills only its new tokens. (In bfloat16:
vLLM's CPU delta-net kernels compute in nothing else. The plans, unit level:
tests/vllm_connector/test_state_plan.py.)"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ctxcache.lmcache_keys import session_key
from ctxcache.redis_server import RedisServer
from sidecar.client import KVClient
from sidecar.protocol import DTYPE_UINT8, FMT_BINARY
from tests.vllm_connector.conftest import VLLM_TIMEOUT, VllmStack, started_stack
from tests.vllm_connector.test_vllm_e2e import Chat, cached, vllm_counter, wait_for

log = logging.getLogger(__name__)

pytestmark = [
    pytest.mark.timeout(VLLM_TIMEOUT),
    pytest.mark.slow,  # an engine start of its own (a model of its own)
]


@pytest.fixture(scope="module")
def hybrid_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[VllmStack]:
    from worker.presets import create_model

    model = create_model("tiny-hybrid", tmp_path_factory.mktemp("models") / "tiny-hybrid")
    with started_stack(tmp_path_factory, redis_server, Path(model), dtype="bfloat16") as stack:
        yield stack


def vllm_log(stack: VllmStack) -> str:
    path = stack.vllm.log_path
    assert path is not None
    return path.read_text(errors="replace")


def state_keys(stack: VllmStack, sid: str) -> list[str]:
    tag = f"s%{session_key(sid)}"
    with KVClient.from_url(stack.sidecar_lm) as kv:
        return [k for k in kv.list_keys() if k.endswith(tag) and "@rs%" in k]


def test_vllm_keeps_its_hybrid_manager_on_and_the_state_group_is_served(
    hybrid_stack: VllmStack,
) -> None:
    text = vllm_log(hybrid_stack)
    assert "Turning off hybrid kv cache manager" not in text
    assert "hybrid KV cache manager on; 2 KV cache groups served" in text
    assert "recurrent state, 2 layers" in text
    assert "is not supported" not in text


def test_vllm_answers_a_chat_and_a_completion_and_the_connector_names_the_kind_once(
    hybrid_stack: VllmStack,
) -> None:
    chat = hybrid_stack.http.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "say something about the weather"}],
            "max_tokens": 12,
            "temperature": 0,
        },
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"]
    prompt = " ".join(["green hills and rain"] * 120)  # ~480 tokens
    done = httpx.post(
        f"{hybrid_stack.vllm.url}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0},
        timeout=300,
    )
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["completion_tokens"] == 8
    lines = re.findall(
        r"ctxcache connector[^\n]*recurrent state[^\n]*groups served", vllm_log(hybrid_stack)
    )
    assert 1 <= len(lines) <= 2, lines  # one per connector vLLM makes: scheduler, worker


def test_after_a_prefix_cache_reset_a_turn_reuses_the_whole_history(
    hybrid_stack: VllmStack,
) -> None:
    """Each turn after a reset finds the history's KV and its last state in the sidecar:
    it reuses all of the history but the last answer's last token (never computed), and
    answers as the whole conversation sent without a session does."""
    chat = Chat(hybrid_stack, seed=21)
    chat.turn("what is the cat doing?")
    wait_for(lambda: bool(state_keys(hybrid_stack, chat.sid)))
    loaded = vllm_counter(hybrid_stack, "loaded_tokens")
    for question in ("and the dogs?", "will it rain?"):
        hybrid_stack.reset_prefix_cache()  # vLLM forgets; only the sidecar has the state
        context = chat.context_tokens()
        _, usage = chat.turn(question)  # also checks the text against the full history
        log.info("turn after a reset: %d of %d history tokens reused", cached(usage), context)
        assert context - 1 <= cached(usage) <= context
    wait_for(lambda: vllm_counter(hybrid_stack, "loaded_tokens") > loaded)


def test_a_corrupt_state_fails_the_load_and_is_recomputed(hybrid_stack: VllmStack) -> None:
    """The state blocks are wrong (same keys, another shape): the load fails as a whole,
    vLLM recomputes the request — the same answer as the whole conversation, never a
    failed step."""
    chat = Chat(hybrid_stack, seed=23)
    chat.turn("what is the cat doing?")
    wait_for(lambda: bool(state_keys(hybrid_stack, chat.sid)))
    with KVClient.from_url(hybrid_stack.sidecar_lm) as kv:
        for key in state_keys(hybrid_stack, chat.sid):
            kv.put(key, bytes(4096), fmt=FMT_BINARY, dtype=DTYPE_UINT8, shape=(1, 2, 4, 4096))
        kv.health()  # a round trip after the PUTs: the sidecar has them
    failures = vllm_counter(hybrid_stack, "load_failures")
    hybrid_stack.reset_prefix_cache()
    chat.turn("and the dogs?")  # answered exactly like the full history
    wait_for(lambda: vllm_counter(hybrid_stack, "load_failures") > failures)
    assert "Traceback" not in vllm_log(hybrid_stack)
