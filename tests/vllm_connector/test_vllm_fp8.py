"""fp8 KV (`--kv-cache-dtype fp8`) on the real vLLM (CPU) with the small preset: a session
comes back from the sidecar at half of bf16's bytes per token, its greedy answers equal a
full recompute's, and an engine restarted with the model's dtype (bf16 here) misses the fp8
blocks, recomputes and answers. One vLLM (two starts) for the module: `make test-slow`.
The restart test comes last: it leaves the engine on bf16.

Served as "tiny" (the name `Chat` asks for); the weights are the small preset's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ctxcache.redis_server import RedisServer
from tests.vllm_connector.conftest import VLLM_TIMEOUT, VllmStack, document, started_stack
from tests.vllm_connector.test_vllm_e2e import BLOCK, Chat, cached, vllm_counter, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(VLLM_TIMEOUT)]

FP8 = ("--kv-cache-dtype", "fp8")
# the small preset's KV per token: 2 (K, V) x 12 layers x 4 kv heads x 64, one byte each
FP8_BYTES_PER_TOKEN = 2 * 12 * 4 * 64


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from worker.presets import create_model

    return create_model("small", tmp_path_factory.mktemp("models") / "small")


@pytest.fixture(scope="module")
def fp8_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, small_model: Path
) -> Iterator[VllmStack]:
    with started_stack(tmp_path_factory, redis_server, small_model, vllm_args=FP8) as stack:
        yield stack


def complete(stack: VllmStack, prompt: list[int], **extra: Any) -> dict[str, Any]:
    """vLLM's greedy completion of the token ids `prompt` (24 tokens, their logprobs)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0}
    r = httpx.post(
        f"{stack.vllm.url}/v1/completions", json=body | {"logprobs": 1} | extra, timeout=300
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def tokens(stack: VllmStack, text: str) -> list[int]:
    r = httpx.post(f"{stack.vllm.url}/tokenize", json={"model": "tiny", "prompt": text})
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def test_an_fp8_session_comes_back_from_the_sidecar_at_half_bf16s_bytes(
    fp8_stack: VllmStack,
) -> None:
    log = fp8_stack.vllm.log_path
    assert log is not None
    assert "float8_e4m3fn KV cache, stored as it is (scales 1.0)" in log.read_text()
    chat = Chat(fp8_stack, seed=31)
    chat.turn("what is the cat doing?")
    held = chat.info()
    assert held["kv_tokens"] >= held["context_tokens"] - BLOCK
    assert held["kv_bytes"] == held["kv_tokens"] * FP8_BYTES_PER_TOKEN  # bf16: twice that
    loaded = vllm_counter(fp8_stack, "loaded_tokens")
    shm = vllm_counter(fp8_stack, "load_bytes_shm")
    for question in ("and the dogs?", "will it rain?"):
        fp8_stack.reset_prefix_cache()  # only the sidecar can supply KV now
        context = chat.context_tokens()
        _, usage = chat.turn(question)  # checks the text against the full history
        assert cached(usage) >= context - BLOCK
    wait_for(lambda: vllm_counter(fp8_stack, "loaded_tokens") > loaded)
    assert vllm_counter(fp8_stack, "load_bytes_shm") > shm


def test_greedy_answers_on_reused_fp8_kv_equal_a_full_recompute(fp8_stack: VllmStack) -> None:
    """On the same token ids, a prompt whose history was loaded from the sidecar answers
    like one recomputed from nothing (a `cache_salt` of its own misses vLLM's prefix cache
    and the sidecar alike): vLLM's CPU attention reads even a prefill's own K and V back
    from the fp8 cache, so a recompute writes the same fp8 bytes the sidecar returns."""
    for seed in (41, 42, 43):
        history = tokens(fp8_stack, document(seed))
        prompt = history + tokens(fp8_stack, " Question: what is the cat doing? Answer:")
        key = f"fp8-recompute-{seed}"
        session = {"kv_transfer_params": {"lmcache.tag.s": key}}
        complete(fp8_stack, history, **session, max_tokens=1)  # stored to the sidecar
        held = f"{fp8_stack.sidecar.url}/sessions/{key}"
        wait_for(lambda: httpx.get(held).json()["tokens"] >= len(history) - BLOCK)  # noqa: B023
        fp8_stack.reset_prefix_cache()
        reused = complete(fp8_stack, prompt, **session)
        full = complete(fp8_stack, prompt, cache_salt=f"recompute-{seed}")
        assert cached(reused["usage"]) >= len(history) - BLOCK
        assert cached(full["usage"]) == 0
        a, b = reused["choices"][0], full["choices"][0]
        assert a["text"] == b["text"]
        assert a["logprobs"]["token_logprobs"] == b["logprobs"]["token_logprobs"]


def test_an_engine_restarted_with_another_kv_dtype_misses_and_answers(
    fp8_stack: VllmStack,
) -> None:
    chat = Chat(fp8_stack, seed=33)
    chat.turn("what is the cat doing?")
    fp8_bytes = chat.info()["kv_bytes"]
    assert fp8_bytes > 0
    vllm = fp8_stack.vllm
    vllm.stop()
    at = vllm.command.index(FP8[0])
    vllm.command[at : at + 2] = []  # --kv-cache-dtype auto: the model's bf16
    vllm.start()
    wait_for(lambda: fp8_stack.http.get("/ready").status_code == 200, timeout=60)
    # (deltas: vLLM's metrics may keep the stopped engine's counts in their directory)
    loaded = vllm_counter(fp8_stack, "loaded_tokens")
    _, usage = chat.turn("and the dogs?")  # checks the text against the full history
    assert cached(usage) == 0  # the fp8 blocks are not this engine's: recomputed
    assert vllm_counter(fp8_stack, "loaded_tokens") == loaded
    held = chat.info()
    assert held["kv_bytes"] > fp8_bytes  # now bf16 blocks beside the fp8 ones
    # and the bf16 engine reuses its own blocks from here on
    fp8_stack.reset_prefix_cache()
    context = chat.context_tokens()
    _, usage = chat.turn("will it rain?")
    assert cached(usage) >= context - BLOCK
    wait_for(lambda: vllm_counter(fp8_stack, "loaded_tokens") > loaded)
