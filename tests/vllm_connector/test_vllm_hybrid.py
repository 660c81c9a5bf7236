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
from typing import Any

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


AGREE = 0.1  # nats: how far two bfloat16 paths' logprobs of one token may lie apart


class Turns(Chat):
    """A conversation whose session turns are compared with the whole conversation sent
    without a session, token by token. In bfloat16 (vLLM's CPU delta-net kernels run in
    nothing else) the two paths round differently — the session's resumes from its
    history's stored state, the whole conversation's from vLLM's own prefix cache and a
    prefill — so a greedy answer may part where two tokens nearly tie: every token up to
    there must agree within `AGREE` and the parting one be a near tie. A wrong or lost
    state moves every logprob far more than that."""

    def ask(self, fields: dict[str, Any]) -> dict[str, Any]:
        body = {"model": "tiny", "max_tokens": 24, "temperature": 0, "logprobs": True}
        r = self.client.post("/v1/chat/completions", json=body | {"top_logprobs": 5} | fields)
        assert r.status_code == 200, r.text
        return dict(r.json())

    def turn(self, question: str) -> tuple[str, dict[str, Any]]:
        user = {"role": "user", "content": question}
        mine = self.ask({"session_id": self.sid, "messages": [user]})
        self.messages += [user]
        full = self.ask({"messages": self.messages, "prompt_cache_options": {"mode": "explicit"}})
        text = mine["choices"][0]["message"]["content"]
        self.messages += [{"role": "assistant", "content": text}]
        agreed = agreement(
            mine["choices"][0]["logprobs"]["content"], full["choices"][0]["logprobs"]["content"]
        )
        log.info("%d of 24 answer tokens as the whole conversation's", agreed)
        return text, mine["usage"]


def agreement(mine: list[dict[str, Any]], full: list[dict[str, Any]]) -> int:
    """How many tokens the two answers share; fails unless they agree as `Turns` says."""
    for i, (a, b) in enumerate(zip(mine, full, strict=False)):
        if a["token"] == b["token"]:
            assert abs(a["logprob"] - b["logprob"]) < AGREE, (i, a, b)
            continue
        assert i > 0, (a, b)  # the first token is not a near tie: a wrong state
        alternatives = {t["token"]: t["logprob"] for t in b["top_logprobs"]}
        assert a["token"] in alternatives, (i, a, b)
        assert b["logprob"] - alternatives[a["token"]] < AGREE, (i, a, b)  # a near tie
        return i
    return min(len(mine), len(full))


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
        r"ctxcache connector[^\n]*groups served[^\n]*recurrent state", vllm_log(hybrid_stack)
    )
    assert 1 <= len(lines) <= 2, lines  # one per connector vLLM makes: scheduler, worker


def test_after_a_prefix_cache_reset_a_turn_reuses_the_whole_history(
    hybrid_stack: VllmStack,
) -> None:
    """Each turn after a reset finds the history's KV and its last state in the sidecar:
    it reuses all of the history but the last answer's last token (never computed), and
    answers as the whole conversation sent without a session does (`Turns`)."""
    chat = Turns(hybrid_stack, seed=21)
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
    # four stores (the create, three turns), one state block each: the newest 2 are kept
    wait_for(lambda: len(state_keys(hybrid_stack, chat.sid)) == 2)


def test_a_corrupt_state_fails_the_load_and_is_recomputed(hybrid_stack: VllmStack) -> None:
    """The state blocks are wrong (same keys, another shape): the load fails as a whole,
    vLLM recomputes the request — the same answer as the whole conversation, never a
    failed step."""
    chat = Turns(hybrid_stack, seed=23)
    chat.turn("what is the cat doing?")
    wait_for(lambda: bool(state_keys(hybrid_stack, chat.sid)))
    with KVClient.from_url(hybrid_stack.sidecar_lm) as kv:
        for key in state_keys(hybrid_stack, chat.sid):
            kv.put(key, bytes(4096), fmt=FMT_BINARY, dtype=DTYPE_UINT8, shape=(1, 2, 4, 4096))
        kv.health()  # a round trip after the PUTs: the sidecar has them
    failures = vllm_counter(hybrid_stack, "load_failures")
    hybrid_stack.reset_prefix_cache()
    chat.turn("and the dogs?")  # answered like the full history (`Turns`)
    wait_for(lambda: vllm_counter(hybrid_stack, "load_failures") > failures)
    assert "Traceback" not in vllm_log(hybrid_stack)


def test_without_prefix_caching_the_connector_refuses_and_vllm_still_answers(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> None:
    """With vLLM's prefix caching off its Mamba group is in `mamba_cache_mode` "none" (no
    state kept at any boundary): the connector refuses the model in one line per side and
    vLLM serves it alone. (A second engine start: the one real refused case the CPU build
    runs.)"""
    from worker.presets import create_model

    model = create_model("tiny-hybrid", tmp_path_factory.mktemp("models") / "tiny-hybrid-nopc")
    with started_stack(
        tmp_path_factory,
        redis_server,
        Path(model),
        dtype="bfloat16",
        vllm_args=("--no-enable-prefix-caching",),
    ) as stack:
        chat = Turns(stack, seed=25)
        _, usage = chat.turn("what is the cat doing?")
        assert cached(usage) == 0
        lines = re.findall(r"ctxcache connector[^\n]*is not supported[^\n]*", vllm_log(stack))
        assert 1 <= len(lines) <= 2, lines
        assert "mamba_cache_mode 'none'" in lines[0]
        assert not state_keys(stack, chat.sid)
