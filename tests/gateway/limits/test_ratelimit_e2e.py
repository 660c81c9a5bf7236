"""The issue's acceptance run: the openai SDK against two real gateway replicas sharing one
Redis (one with the manager in its process, one through the manager service), in front of a
real worker (tiny model). A key with `rpm=30`: 60 requests at once ->
exactly 30 succeed, the other 30 get 429 with `retry-after-ms`; the SDK's own retries
(`max_retries`) then complete all 60, each refused request retried once, after the window's
end (the window is shortened with CTX_GATEWAY_RATE_LIMIT_WINDOW_S). The same with `tpm`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from ctxcache.redis_server import RedisServer
from tests.gateway.replicas import two_gateways
from tests.utils import metric

WINDOW_S = 10.0  # long enough for a burst of 60 to arrive within one window, even on a busy CI
PROMPT = [11, 12, 13, 14]  # token ids: the estimate is exact (one token each)
MAX_TOKENS = 8  # with ignore_eos: usage.total_tokens = 12, exactly the reservation
TPM = 30 * (len(PROMPT) + MAX_TOKENS)
METRICS_TOKEN = "tenant-metrics-token-e2e"


@dataclass
class Replicas:
    urls: list[str]  # the two gateways
    worker: str

    def __getitem__(self, i: int) -> str:
        return self.urls[i]


@pytest.fixture(scope="module")
def replicas(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, tiny_model: Path
) -> Iterator[Replicas]:
    keys = ["k-rpm=acme:rpm=30", f"k-tpm=acme:tpm={TPM}"]
    keys += ["k-big=beta:tpm=100000", "k-gone=gamma:tpm=100000"]
    env = {
        "CTX_GATEWAY_RATE_LIMIT_WINDOW_S": str(WINDOW_S),
        "CTX_GATEWAY_METRICS_TOKEN": METRICS_TOKEN,
    }
    with two_gateways(
        tmp_path_factory.mktemp("ratelimit"), redis_server.url, tiny_model, keys=keys, env=env
    ) as (worker, gateways):
        yield Replicas(gateways, worker)


def limited_total(replicas: Replicas, limit: str) -> float:
    headers = {"authorization": f"Bearer {METRICS_TOKEN}"}
    name = f'ctxcache_tenant_rate_limited_total{{limit="{limit}",tenant="acme"}}'
    return sum(
        metric(httpx.get(f"{u}/metrics/tenants", headers=headers).text, name) for u in replicas.urls
    )


async def burst_raw(replicas: Replicas, key: str) -> list[httpx.Response]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60, headers={"authorization": f"Bearer {key}"}) as http:
        return await asyncio.gather(
            *(http.post(f"{replicas[i % 2]}/v1/completions", json=body) for i in range(60))
        )


async def burst_sdk(urls: list[str], key: str) -> list[int]:
    clients = [
        openai.AsyncOpenAI(base_url=f"{u}/v1", api_key=key, max_retries=3, timeout=60) for u in urls
    ]
    try:
        done = await asyncio.gather(
            *(
                clients[i % 2].completions.create(
                    model="tiny",
                    prompt=PROMPT,
                    max_tokens=MAX_TOKENS,
                    extra_body={"ignore_eos": True},
                )
                for i in range(60)
            )
        )
    finally:
        for c in clients:
            await c.close()
    return [c.usage.total_tokens for c in done if c.usage is not None]


@pytest.mark.parametrize(
    ("key", "limit"),
    [
        ("k-rpm", "requests"),
        # two 10 s windows; tpm's reservations and refunds are also tested in
        # test_tpm_charges(_e2e).py: make test-slow (docs/testing.md)
        pytest.param("k-tpm", "tokens", marks=pytest.mark.slow),
    ],
)
async def test_sdk_burst_on_two_replicas(replicas: Replicas, key: str, limit: str) -> None:
    answers = await burst_raw(replicas, key)
    ok = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code == 429]
    assert len(ok) == 30 and len(refused) == 30, [r.status_code for r in answers]
    assert {r.json()["usage"]["total_tokens"] for r in ok} == {len(PROMPT) + MAX_TOKENS}
    waits = [int(r.headers["retry-after-ms"]) for r in refused]
    assert all(0 < w <= WINDOW_S * 1000 for w in waits)
    assert {r.json()["error"]["code"] for r in refused} == {"rate_limit_exceeded"}
    header = f"x-ratelimit-remaining-{limit}"
    assert {r.headers[header] for r in refused} == {"0"}
    await asyncio.sleep(max(waits) / 1000 + 0.1)  # a fresh window

    before = limited_total(replicas, limit)
    t0 = time.monotonic()
    totals = await burst_sdk(replicas, key)
    elapsed = time.monotonic() - t0
    assert totals == [len(PROMPT) + MAX_TOKENS] * 60  # all 60 completed
    # each refused request was retried exactly once, when the window had ended: an early
    # retry would have been refused again, a late one is what the budget allows
    assert limited_total(replicas, limit) - before == 30
    assert elapsed > WINDOW_S * 0.5  # half of them had to wait for the next window


def test_responses_settle_to_their_usage(
    replicas: Replicas, request: pytest.FixtureRequest
) -> None:
    """A Responses answer (JSON, and a stream's `response.completed`) and a chat turn on a
    session are charged their real `usage.total_tokens`: the next request's headers show
    the budget minus what was used, not minus the reservations."""
    client = openai.OpenAI(base_url=f"{replicas[0]}/v1", api_key="k-big", max_retries=0)
    request.addfinalizer(client.close)
    spent = 0
    raw = client.responses.with_raw_response.create(
        model="tiny", input="hello there", max_output_tokens=8
    )
    first = raw.parse()
    assert first.usage is not None
    spent += first.usage.total_tokens
    stream = client.responses.create(
        model="tiny", input="again", previous_response_id=first.id, max_output_tokens=8, stream=True
    )
    ends = [e for e in stream if e.type in ("response.completed", "response.incomplete")]
    assert len(ends) == 1 and ends[0].response.usage is not None  # type: ignore[union-attr]
    spent += ends[0].response.usage.total_tokens  # type: ignore[union-attr]
    # (the session's context counts, as in OpenAI's usage)
    probe = client.completions.with_raw_response.create(
        model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True}
    )
    reserved = len(PROMPT) + MAX_TOKENS
    assert probe.headers["x-ratelimit-remaining-tokens"] == str(100000 - spent - reserved)
    client.close()


def running(replicas: Replicas) -> float:
    return metric(httpx.get(f"{replicas.worker}/metrics").text, "ctxcache_worker_running")


def wait_idle(replicas: Replicas) -> None:
    deadline = time.monotonic() + 10
    while running(replicas) != 0:
        assert time.monotonic() < deadline, "the worker still generates for nobody"
        time.sleep(0.02)


def engine_tokens(replicas: Replicas) -> int:
    """What the worker reports having read and generated, all requests so far."""
    text = httpx.get(f"{replicas.worker}/metrics").text
    read = metric(text, "ctxcache_worker_prompt_tokens_total")
    return int(read + metric(text, "ctxcache_worker_generated_tokens_total"))


def test_a_limited_key_that_leaves_still_cancels_and_is_charged_fairly(
    replicas: Replicas,
) -> None:
    """The limiter reads the body ahead and watches the answer, and still the client's
    leaving reaches the worker. A request that left before its answer reached the engine,
    which says nothing of what it did: it keeps its reservation. A stream cut mid-way is
    charged its prompt and the tokens relayed until then: what the engine did, give or
    take the tokens in flight, not its reservation."""
    auth = {"authorization": "Bearer k-gone"}
    long = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True}
    reserved = len(PROMPT) + 3000
    probe_body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "ignore_eos": True}
    probe_cost = len(PROMPT) + 1

    probes = 0

    def remaining() -> int:
        """The tokens left after a probe (which costs `probe_cost`, reserved and used)."""
        nonlocal probes
        probes += 1
        r = httpx.post(f"{replicas[0]}/v1/completions", json=probe_body, headers=auth)
        assert r.status_code == 200
        return int(r.headers["x-ratelimit-remaining-tokens"])

    def charged_since_first_probe(low: int, high: int | None = None) -> bool:
        """Whether the budget shows from `low` to `high` tokens charged beyond the probes
        (a settlement runs as the request's task ends, just after the worker stopped:
        polled a while)."""
        deadline = time.monotonic() + 10
        while True:
            left = remaining()
            charged = first - (probes - 1) * probe_cost - left
            if low <= charged <= (low if high is None else high):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)

    wait_idle(replicas)
    first = remaining()
    leaving = httpx.Client(base_url=replicas[0], headers=auth)
    with pytest.raises(httpx.ReadTimeout), leaving:  # hangs up after 1.5 s
        leaving.post("/v1/completions", json=long, timeout=httpx.Timeout(10, read=1.5))
    wait_idle(replicas)
    assert charged_since_first_probe(reserved)  # the request that left kept its reservation

    wait_idle(replicas)
    first, probes = remaining(), 1
    before = engine_tokens(replicas)
    with (
        httpx.Client(base_url=replicas[0], headers=auth, timeout=30) as http,
        http.stream("POST", "/v1/completions", json={**long, "stream": True}) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        next(lines)  # mid-stream
        next(lines)
    wait_idle(replicas)
    engine = engine_tokens(replicas) - before
    assert len(PROMPT) < engine < reserved / 2  # (it was cut early)
    slack = len(PROMPT) + MAX_TOKENS  # one request's estimate
    assert charged_since_first_probe(engine - slack, engine)  # the cut stream: what it did
    time.sleep(0.5)
    assert charged_since_first_probe(engine - slack, engine)  # ... after its settlement too
