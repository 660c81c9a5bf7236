"""A `tpm` key is charged what the engine did (docs/limits.md, "What counts"), on real
processes: the openai SDK against two gateway replicas sharing one Redis (one with the
manager in its process, one through the manager service), in front of one real worker (tiny
model) whose own counters (`ctxcache_worker_prompt_tokens`, `_generated_tokens`) say what
the engine read and generated. After each request — streamed and not, a stream its client
hangs up on, a session turn whose session is deleted while it runs — the budget the next
request's `x-ratelimit-remaining-tokens` shows is the limit minus what the engine reported,
within one request's estimate."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from ctxcache.redis_server import RedisServer
from tests.gateway.replicas import two_gateways
from tests.utils import metric

TPM = 1_000_000
KEY = "k-sdk"
PROBE = [11, 12, 13, 14]  # token ids: the probe's estimate is exact
PROBE_MAX = 8  # with ignore_eos: a probe reserves and uses 12
PROBE_COST = len(PROBE) + PROBE_MAX
MAX = 64  # the answers' maximum: one request's estimate is about this (+ its prompt)
SLACK = 4 + MAX  # one request's estimate (a short prompt + MAX)


@dataclass
class Stack:
    gateways: list[str]
    worker: str

    def engine_tokens(self) -> int:
        """What the worker reports having read and generated, all requests so far."""
        text = httpx.get(f"{self.worker}/metrics").text
        read = metric(text, "ctxcache_worker_prompt_tokens_total")
        generated = metric(text, "ctxcache_worker_generated_tokens_total")
        return int(read + generated)

    def wait_idle(self) -> None:
        deadline = time.monotonic() + 20
        while metric(httpx.get(f"{self.worker}/metrics").text, "ctxcache_worker_running"):
            assert time.monotonic() < deadline, "the worker still generates for nobody"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, tiny_model: Path
) -> Iterator[Stack]:
    env = {"CTX_GATEWAY_RATE_LIMIT_WINDOW_S": "3600"}  # one window for the whole test
    with two_gateways(
        tmp_path_factory.mktemp("tpm"),
        redis_server.url,
        tiny_model,
        keys=[f"{KEY}=sdk:tpm={TPM}"],
        env=env,
    ) as (worker, gateways):
        yield Stack(gateways, worker)


@pytest.fixture
def clients(stack: Stack) -> Iterator[list[openai.OpenAI]]:
    made = [
        openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        for url in stack.gateways
    ]
    yield made
    for client in made:
        client.close()


def remaining(client: openai.OpenAI) -> int:
    """The budget left before a probe (which reserves, and then uses, `PROBE_COST`)."""
    raw = client.completions.with_raw_response.create(
        model="tiny", prompt=PROBE, max_tokens=PROBE_MAX, extra_body={"ignore_eos": True}
    )
    assert raw.parse().usage.total_tokens == PROBE_COST  # type: ignore[union-attr]
    return int(raw.headers["x-ratelimit-remaining-tokens"]) + PROBE_COST


Check = Callable[..., None]


@pytest.fixture
def charged_as_engine(stack: Stack, clients: list[openai.OpenAI]) -> Check:
    """`check(what, exact=True)`: the key's budget (read through each replica in turn) is
    the limit minus what the engine reported since the first check within one request's
    estimate, and (`exact`) the request made since the last check cost exactly what the
    engine reported for it. The settlement of a request runs as its task ends, just after
    its client has the answer: polled a moment."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    probes = [0]

    def check(what: str, exact: bool = True) -> None:
        stack.wait_idle()
        deadline = time.monotonic() + 5
        while True:
            engine = stack.engine_tokens()
            left = remaining(clients[probes[0] % 2])
            probes[0] += 1
            if not first:  # the start: the budget and the engine agree so far
                first.update(engine=engine, left=left)
                last.update(first)
                return
            overall = first["left"] - (engine - first["engine"])
            step = last["left"] - (engine - last["engine"])
            if abs(left - overall) <= SLACK and (left == step or not exact):
                last.update(engine=engine, left=left)
                return
            assert time.monotonic() < deadline, (what, left, overall, step)
            time.sleep(0.1)

    check("start")
    return check


def test_the_budget_is_what_the_engine_did(
    stack: Stack, clients: list[openai.OpenAI], charged_as_engine: Check
) -> None:
    a, b = clients
    messages = [{"role": "user", "content": "Tell me a long story about the sea."}]
    extra = {"ignore_eos": True}

    # a streamed answer, its client asking no usage (the openai SDK's default)
    stream = a.chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX, stream=True, extra_body=extra
    )
    chunks = list(stream)
    assert chunks and all(c.usage is None for c in chunks)  # no usage chunk it did not ask
    charged_as_engine("streamed")

    # a non-streamed answer
    answer = b.chat.completions.create(
        model="tiny", messages=messages, max_tokens=MAX, extra_body=extra
    )
    assert answer.usage is not None and answer.usage.completion_tokens == MAX
    charged_as_engine("non-streamed")

    # a hang-up mid-stream: charged its prompt and the tokens relayed until then, not its
    # 3000-token reservation, and not nothing
    long = a.chat.completions.create(
        model="tiny", messages=messages, max_tokens=3000, stream=True, extra_body=extra
    )
    for i, _ in enumerate(long):
        if i == 20:
            break
    long.close()
    charged_as_engine("hang-up", exact=False)

    # a session turn whose session is deleted while the engine generates: its commit
    # answers 404, and still the turn pays the context it read and what it generated
    for streamed in (False, True):
        sid = httpx.post(
            f"{stack.gateways[1]}/v1/context",
            json={"model": "tiny", "messages": messages, "max_tokens": 4},
            headers={"authorization": f"Bearer {KEY}"},
        ).json()["session_id"]
        charged_as_engine("create")
        deleter = threading.Timer(  # a second or more before the turn's 800 tokens end
            0.5,
            lambda sid=sid: httpx.delete(
                f"{stack.gateways[1]}/v1/context/{sid}",
                headers={"authorization": f"Bearer {KEY}"},
            ),
        )
        deleter.start()
        turn = {"model": "tiny", "messages": [{"role": "user", "content": "Go on."}]}
        body = {**extra, "session_id": sid}
        with pytest.raises(openai.APIError) as failed:
            if streamed:
                for _ in a.chat.completions.create(
                    **turn, max_tokens=800, stream=True, extra_body=body
                ):
                    pass
            else:
                a.chat.completions.create(**turn, max_tokens=800, extra_body=body)
        deleter.join()
        assert "session_not_found" in str(failed.value.body or failed.value.message)
        charged_as_engine("deleted mid-turn")


def test_a_streamed_turn_pays_its_context_as_a_non_streamed_one(
    stack: Stack, clients: list[openai.OpenAI], charged_as_engine: Check
) -> None:
    """A session turn's usage counts the session's context as prompt. A streamed turn whose
    client asks no usage paid only its reservation (an estimate of the new message) before;
    now it pays what the engine read and generated, as the same turn not streamed does."""
    a, b = clients
    document = " ".join(f"line {i} of a long document." for i in range(120))
    created = httpx.post(
        f"{stack.gateways[0]}/v1/context",
        json={"model": "tiny", "messages": [{"role": "user", "content": document}]},
        headers={"authorization": f"Bearer {KEY}"},
    ).json()
    assert created["session"]["context_tokens"] > 500
    # (a create that only prefills asks the engine for one token, and drops it: vLLM wants
    # max_tokens >= 1; it is charged the usage it answers, its prompt)
    charged_as_engine("create", exact=False)
    turn = {"model": "tiny", "messages": [{"role": "user", "content": "Summarise it."}]}
    body = {"session_id": created["session_id"], "ignore_eos": True}
    answer = a.chat.completions.create(**turn, max_tokens=MAX, extra_body=body)
    assert answer.usage is not None and answer.usage.prompt_tokens > 500
    charged_as_engine("non-streamed turn")
    chunks = list(b.chat.completions.create(**turn, max_tokens=MAX, stream=True, extra_body=body))
    assert all(c.usage is None for c in chunks)
    charged_as_engine("streamed turn")
