"""Real vLLM (CPU) serving an MLA model (the `tiny-mla` preset: DeepSeek-V3's latent
attention, 512 + 64 channels a token and layer) with the connector, in float32, behind the
gateway: a stack of its own, one engine start for the module.

vLLM's CPU build turns its prefix cache (and chunked prefill) off for MLA models without AMX,
so every token a session turn reuses comes from the sidecar; the reset before each turn
makes that so on a CPU that has AMX too. Every answer is checked against the same
conversation sent in full (`Chat.turn`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
        tmp_path_factory, redis_server, mla_model, extra_args=("--dtype", "float32")
    ) as stack:
        yield stack


def vllm_log(stack: VllmStack) -> str:
    return (stack.root / "vllm.log").read_text(errors="replace")


def test_the_connector_serves_the_latent_cache(mla_stack: VllmStack) -> None:
    log = vllm_log(mla_stack)
    assert "is not supported" not in log  # not refused
    assert "MLA latent of 576 channels" in log  # the worker learned its layout


def test_turns_reuse_the_latent_from_the_sidecar_and_answer_like_the_full_history(
    mla_stack: VllmStack, record_property: Any
) -> None:
    chat = Chat(mla_stack, seed=21)
    chat.turn("what is the cat doing?")
    loaded = vllm_counter(mla_stack, "loaded_tokens")
    reused, turns = 0, []
    for question in ("and the dogs?", "will it rain?", "what of the hills?"):
        mla_stack.reset_prefix_cache()  # (a no-op here: vLLM's CPU MLA has none)
        context = chat.context_tokens()
        _, usage = chat.turn(question)  # also checks the text against the full history
        assert context - BLOCK <= cached(usage) <= context
        reused += cached(usage)
        turns.append((context, cached(usage)))
    record_property("context_and_cached_tokens", turns)
    record_property("session_held", mla_stack.held(chat.sid))
    wait_for(lambda: vllm_counter(mla_stack, "loaded_tokens") >= loaded + reused)
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
    chat = Chat(mla_stack, seed=22)
    chat.turn("what is the cat doing?")
    wait_for(lambda: mla_stack.held(chat.sid)["blocks"] > 0)
    mla_stack.restart_sidecar()  # a clean stop writes memory to disk; the start reads it
    counters = {n: vllm_counter(mla_stack, n) for n in ("load_bytes_shm", "load_bytes_tcp")}
    context = chat.context_tokens()
    _, usage = chat.turn("and the dogs?")
    assert context - BLOCK <= cached(usage) <= context
    moved = {n: vllm_counter(mla_stack, n) - v for n, v in counters.items()}
    record_property("context_and_cached_tokens", (context, cached(usage)))
    record_property("loaded_bytes_after_restart", moved)
