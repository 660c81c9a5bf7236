"""Real vLLM (CPU) serving an MLA model (the `tiny-mla` preset: DeepSeek-V3's latent
attention, 512 + 64 channels a token and layer) with the connector, in float32, behind the
gateway: a stack of its own, one engine start for the module.

vLLM's CPU build turns its prefix cache (and chunked prefill) off for MLA models without AMX,
so every token a session turn reuses comes from the sidecar; the reset before each turn
makes that so on a CPU that has AMX too. Every answer is checked against the same
conversation sent in full to vLLM itself (`DirectChat`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ctxcache.lmcache_keys import parse_key, session_key
from ctxcache.redis_server import RedisServer
from sidecar.client import KVClient
from tests.vllm_connector.conftest import VLLM_TIMEOUT, VllmStack, started_stack
from tests.vllm_connector.test_vllm_e2e import Chat, cached, vllm_counter, wait_for

pytestmark = [
    pytest.mark.slow,  # an engine start of its own (a vLLM stack of another model)
    pytest.mark.timeout(VLLM_TIMEOUT),
]

BLOCK = 16  # vLLM's CPU MLA block: what a session turn may recompute at most


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.presets import create_model

    return create_model("tiny-mla", tmp_path_factory.mktemp("models") / "tiny-mla")


@pytest.fixture(scope="module")
def mla_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, mla_model: Path
) -> Iterator[VllmStack]:
    with started_stack(
        tmp_path_factory, redis_server, mla_model, vllm_args=("--dtype", "float32")
    ) as stack:
        yield stack


class DirectChat(Chat):
    """A session through the gateway, checked against the whole conversation sent to vLLM
    itself: no session tag (the connector neither looks it up nor stores it), no gateway
    (which would serve a resent conversation as an implicit session, from the sidecar), and
    vLLM's CPU MLA has no prefix cache: every token of it is computed."""

    def full_text(self) -> str:
        body = {"model": "tiny", "messages": self.messages, "max_tokens": 24, "temperature": 0}
        r = httpx.post(f"{self.stack.vllm.url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert cached(r.json()["usage"]) == 0  # computed, nothing reused
        return str(r.json()["choices"][0]["message"]["content"])


def vllm_log(stack: VllmStack) -> str:
    return (stack.root / "vllm.log").read_text(errors="replace")


def test_the_connector_serves_the_latent_cache(mla_stack: VllmStack) -> None:
    log = vllm_log(mla_stack)
    assert "is not supported" not in log  # not refused
    assert "MLA latent of 576 channels" in log  # the worker learned its layout


def test_turns_reuse_the_latent_from_the_sidecar_and_answer_like_the_full_history(
    mla_stack: VllmStack, record_property: Any
) -> None:
    loaded = vllm_counter(mla_stack, "loaded_tokens")  # (no request since the last settled)
    chat = DirectChat(mla_stack, seed=21)
    reused, turns = 0, []
    for question in ("what is the cat doing?", "and the dogs?", "will it rain?", "of hills?"):
        mla_stack.reset_prefix_cache()  # (a no-op here: vLLM's CPU MLA has none)
        context = chat.context_tokens()
        _, usage = chat.turn(question)  # also checks the text against vLLM's own answer
        assert context - BLOCK <= cached(usage) <= context
        reused += cached(usage)
        turns.append((context, cached(usage)))
    record_property("context_and_cached_tokens", turns)
    record_property("session_held", mla_stack.held(chat.sid))
    # what was reused is what the connector wrote into vLLM's cache, once (vLLM's counters
    # arrive with its stats, a few seconds late)
    wait_for(lambda: vllm_counter(mla_stack, "loaded_tokens") >= loaded + reused)
    assert vllm_counter(mla_stack, "loaded_tokens") == loaded + reused
    assert vllm_counter(mla_stack, "load_bytes_shm") > 0  # the local sidecar's shared memory
    # the session's blocks: rankless keys with the latent format's version
    tag = f"s%{session_key(chat.sid)}"
    with KVClient.from_url(mla_stack.sidecar_lm) as kv:
        keys = [parse_key(k) for k in kv.list_keys() if k.endswith(tag)]
    assert keys and {(k.world_size, k.worker_id) for k in keys} == {(1, 0)}
    assert all(k.tags[0] == ("mla", "1") for k in keys)


def test_after_a_sidecar_restart_the_latent_comes_back_from_the_disk_tier(
    mla_stack: VllmStack, record_property: Any
) -> None:
    chat = DirectChat(mla_stack, seed=22)
    chat.turn("what is the cat doing?")
    wait_for(lambda: mla_stack.held(chat.sid)["blocks"] > 0)
    mla_stack.restart_sidecar()  # a clean stop writes memory to disk; the start reads it
    context = chat.context_tokens()
    _, usage = chat.turn("and the dogs?")
    assert context - BLOCK <= cached(usage) <= context
    record_property("context_and_cached_tokens", (context, cached(usage)))
    # through the new sidecar's shared memory (the connector found its region again)
    assert vllm_counter(mla_stack, "load_bytes_tcp") == 0
