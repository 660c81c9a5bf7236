"""The real vLLM (CPU build) with the ctxcache connector on a preset the connector does not
serve (`ctxcache model create --preset tiny-hybrid`): it starts, it answers a chat and a
completion, and the connector says in one start-up line what kind of model it was given.
One engine start per preset, shared by its tests (the served kinds' stacks: their own
modules).

What the connector then does with each kind (serve a group, refuse it, store a window) is
its own tests' business; these hold only what must stay true whatever it does: vLLM is never
kept from starting or answering by the connector.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ctxcache.redis_server import RedisServer
from tests.vllm_connector.conftest import VLLM_TIMEOUT, VllmStack, started_stack

# The connector is `SupportsHMA`, so vLLM keeps its hybrid KV-cache manager on: a
# sliding-window model's groups are served (one line names them), and a hybrid
# (Mamba/linear-attention) model, which does not start at all without that manager ("Failed
# to promote local KV cache specs to one unified type"), runs with the cache off (one line
# says why).
# preset: (a word the connector's start-up line has for its kind, vLLM's dtype, marks)
KINDS = {
    # vLLM's CPU gated-delta-net kernels compute in bfloat16 only. (The other kinds' stacks
    # are their own modules': test_vllm_sliding.py runs tiny-sliding and tiny-gemma3,
    # test_vllm_mla.py tiny-mla, each checking its start-up line; one engine start each.)
    "tiny-hybrid": (r"hybrid|Mamba|linear", "bfloat16", (pytest.mark.slow,)),
}
LINE = re.compile(r"ctxcache connector[^\n]*")

pytestmark = pytest.mark.timeout(VLLM_TIMEOUT)


@pytest.fixture(
    scope="module",
    params=[pytest.param(name, marks=KINDS[name][2]) for name in KINDS],
)
def preset_stack(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    redis_server: RedisServer,
) -> Iterator[tuple[str, VllmStack]]:
    from worker.presets import create_model

    name: str = request.param
    model = create_model(name, tmp_path_factory.mktemp("models") / name)
    dtype = KINDS[name][1]
    with started_stack(
        tmp_path_factory, redis_server, Path(model), served_name=name, dtype=dtype
    ) as stack:
        yield name, stack


def test_vllm_starts_and_answers(
    preset_stack: tuple[str, VllmStack],
) -> None:
    name, stack = preset_stack
    chat = stack.http.post(
        "/v1/chat/completions",
        json={
            "model": name,
            "messages": [{"role": "user", "content": "say something about the weather"}],
            "max_tokens": 12,
            "temperature": 0,
        },
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"]
    prompt = " ".join(["green hills and rain"] * 120)  # ~480 tokens: past a 256-token window
    done = httpx.post(
        f"{stack.vllm.url}/v1/completions",
        json={"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0},
        timeout=300,
    )
    assert done.status_code == 200, done.text
    body = done.json()
    assert body["usage"]["prompt_tokens"] > 256 and body["usage"]["completion_tokens"] == 8


def test_the_connector_names_the_model_kind_once(
    preset_stack: tuple[str, VllmStack],
) -> None:
    name, stack = preset_stack
    word = KINDS[name][0]
    assert stack.vllm.log_path is not None
    log = stack.vllm.log_path.read_text(errors="replace")
    lines = [line for line in LINE.findall(log) if re.search(word, line, re.I)]
    # one line per connector vLLM makes: its scheduler's and its worker's
    assert 1 <= len(lines) <= 2, (lines, LINE.findall(log))
