"""The `tiny-mla` preset on real vLLM (CPU) with `--tensor-parallel-size 2`: two worker
processes, each holding the whole latent (vLLM replicates MLA's one KV head), one
connector per rank. The latent is stored once, by rank 0, under keys that name no rank,
and both ranks load it. A stack of its own (one engine start for the module).

vLLM's CPU build binds each rank's threads to a NUMA node of its own by default
(`VLLM_CPU_OMP_THREADS_BIND=auto`) and does not start with fewer nodes than ranks; on such
a machine (this one has one node) `ctxcache vllm`'s launch gives each rank a run of CPUs
(`0|1`, `ctxcache.vllm_engine.rank_cpus`), which this module relies on: it sets nothing.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ctxcache.lmcache_keys import parse_key, session_key
from ctxcache.redis_server import RedisServer
from sidecar.client import KVClient
from tests.vllm_connector.conftest import VLLM_TIMEOUT, VllmStack, started_stack
from tests.vllm_connector.test_vllm_e2e import cached, vllm_counter, wait_for
from tests.vllm_connector.test_vllm_mla import (  # noqa: F401 (mla_model: a fixture)
    BLOCK,
    DirectChat,
    mla_model,
)

pytestmark = [
    pytest.mark.slow,  # an engine start of its own: two ranks, a process each
    pytest.mark.timeout(VLLM_TIMEOUT),
]


def cpu_lists() -> str:
    """One CPU per rank for vLLM's thread binding: `0|1` on this 2-CPU machine."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("tensor parallelism on CPU needs a CPU per rank")
    half = len(cpus) // 2
    return "|".join(",".join(map(str, part)) for part in (cpus[:half], cpus[half : 2 * half]))


@pytest.fixture(scope="module")
def tp_stack(
    tmp_path_factory: pytest.TempPathFactory,
    redis_server: RedisServer,
    mla_model: Path,  # noqa: F811
) -> Iterator[VllmStack]:
    cpu_lists()  # (skips on one CPU)
    with pytest.MonkeyPatch.context() as env:
        env.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)  # the launch's own binding
        with started_stack(
            tmp_path_factory,
            redis_server,
            mla_model,
            vllm_args=("--dtype", "float32", "--tensor-parallel-size", "2"),
        ) as stack:
            yield stack


def test_both_ranks_serve_the_latent_rank_0_stores_it(tp_stack: VllmStack) -> None:
    log = (tp_stack.root / "vllm.log").read_text(errors="replace")
    assert "tensor_parallel_size=2" in log
    lines = re.findall(r"ctxcache connector: .*MLA latent of 576 channels \((\w+) here", log)
    assert sorted(lines) == ["loaded", "stored"]  # one connector per rank


def test_the_latent_is_stored_once_and_both_ranks_load_it(
    tp_stack: VllmStack, record_property: Any
) -> None:
    loaded = vllm_counter(tp_stack, "loaded_tokens")  # (no request before this test)
    left = vllm_counter(tp_stack, "stores_left_to_rank0")
    chat = DirectChat(tp_stack, seed=31)
    reused, turns = 0, []
    for question in ("what is the cat doing?", "and the dogs?", "will it rain?"):
        tp_stack.reset_prefix_cache()
        context = chat.context_tokens()
        _, usage = chat.turn(question)  # also checks the text against vLLM's own answer
        assert context - BLOCK <= cached(usage) <= context
        reused += cached(usage)
        turns.append((context, cached(usage)))
    record_property("context_and_cached_tokens", turns)
    # each of the two ranks wrote what was reused into its own cache, once (vLLM sums its
    # workers' counters, and they arrive with its stats, a few seconds late)
    wait_for(lambda: vllm_counter(tp_stack, "loaded_tokens") >= loaded + 2 * reused)
    assert vllm_counter(tp_stack, "loaded_tokens") == loaded + 2 * reused
    assert vllm_counter(tp_stack, "stores_left_to_rank0") > left  # rank 1 stored nothing
    tag = f"s%{session_key(chat.sid)}"
    with KVClient.from_url(tp_stack.sidecar_lm) as kv:
        keys = [parse_key(k) for k in kv.list_keys() if k.endswith(tag)]
    record_property("session_blocks", len(keys))
    assert keys and {(k.world_size, k.worker_id) for k in keys} == {(1, 0)}  # one copy
    held = tp_stack.held(chat.sid)
    record_property("session_held", held)
    # once: the latent of its tokens, not twice (4 layers x 576 float32 channels a token)
    assert held["bytes"] == held["tokens"] * 4 * 576 * 4
