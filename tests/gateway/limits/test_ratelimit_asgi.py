"""Per-key rate limits in the gateway as `ctxcache gateway` serves it (create_app on uvicorn
with its server config, the in-process manager on a real Redis), in front of a scripted worker
whose answers' `usage` the test chooses: the 429 and its headers, the x-ratelimit-* headers
on every answer, reservations settled to the real usage (JSON, stream), streams without a
session limited too, a store outage failing open or closed, per-tenant
metrics behind their token."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest

from ctxcache.redis_server import RedisServer
from tests.gateway.rawhttp import chunk
from tests.gateway.scripted import Gateways, ScriptedWorker, answer
from tests.utils import metric

KEYS = {
    "k-rpm": "acme:rpm=3",
    "k-tpm": "acme:tpm=200",
    "k-both": "beta:rpm=100,tpm=1000",
    "k-free": "free",
}
USED = 7  # the scripted worker's usage.total_tokens
METRICS_TOKEN = "metrics-token-0123456789"


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def usage_answer(body: dict) -> bytes:
    """A whole answer, JSON or a stream, that reports `USED` tokens."""
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": USED}
    if not body.get("stream"):
        return answer(
            200, orjson.dumps({"object": "text_completion", "choices": [], "usage": usage})
        )
    events = [b'data: {"choices": [{"text": "a"}]}\n\n']
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    head += b"transfer-encoding: chunked\r\n\r\n"
    return head + b"".join(map(chunk, events)) + b"0\r\n\r\n"


async def reply(_: asyncio.StreamReader, w: asyncio.StreamWriter, body: dict) -> None:
    w.write(usage_answer(body))


@pytest.fixture
def serve() -> Iterator[Callable[..., str]]:
    """`serve(redis_url, **settings)`: a gateway on uvicorn with our protocol; its URL."""
    gateways = Gateways()
    worker = ScriptedWorker(reply).start()

    def start(redis_url: str, **settings: object) -> str:
        fields: dict = {
            "redis_url": redis_url,
            "workers": [f"http://127.0.0.1:{worker.port}"],
            "api_keys": KEYS,
            "health_interval_s": 0.2,
            "rate_limit_window_s": 60,
            **settings,
        }
        return gateways.start(**fields)

    yield start
    gateways.close()


def completion(url: str, key: str, **body: object) -> httpx.Response:
    doc = {"model": "m", "prompt": "hello", "max_tokens": 10, **body}
    return httpx.post(f"{url}/v1/completions", json=doc, headers=auth(key), timeout=10)


def test_rpm_429_and_headers_on_every_answer(serve: Callable[..., str], redis_url: str) -> None:
    url = serve(redis_url, rate_limit_window_s=1.5)
    first = completion(url, "k-rpm")
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "3"
    assert first.headers["x-ratelimit-remaining-requests"] == "2"
    assert first.headers["x-ratelimit-reset-requests"].endswith(("s", "ms"))
    assert "x-ratelimit-limit-tokens" not in first.headers  # no tpm on this key
    # any route under /v1/ counts, and carries the headers, errors included
    listing = httpx.get(f"{url}/v1/context", headers=auth("k-rpm"))
    assert listing.status_code == 200 and listing.headers["x-ratelimit-remaining-requests"] == "1"
    missing = httpx.get(f"{url}/v1/context/ctx_" + "A" * 32, headers=auth("k-rpm"))
    assert missing.status_code == 404 and missing.headers["x-ratelimit-remaining-requests"] == "0"
    refused = completion(url, "k-rpm")
    assert refused.status_code == 429
    err = refused.json()["error"]
    assert err["code"] == err["type"] == "rate_limit_exceeded"
    assert "requests per minute (rpm): limit 3, used 3" in err["message"]
    wait_ms = int(refused.headers["retry-after-ms"])
    assert 0 < wait_ms <= 1500 and int(refused.headers["retry-after"]) == -(-wait_ms // 1000)
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    # another key, and a key without limits, are not touched (and the latter has no headers)
    free = completion(url, "k-free")
    assert free.status_code == 200 and "x-ratelimit-limit-requests" not in free.headers
    assert completion(url, "k-both").status_code == 200
    time.sleep(wait_ms / 1000 + 0.05)
    again = completion(url, "k-rpm")
    assert again.status_code == 200 and again.headers["x-ratelimit-remaining-requests"] == "2"
    # a bad key is the app's 401, not counted anywhere
    assert completion(url, "k-wrong").status_code == 401
    text = httpx.get(f"{url}/metrics").text
    assert metric(text, 'ctxcache_gateway_rate_limited_total{limit="requests"}') == 1


def test_tokens_are_reserved_then_settled_to_usage(
    serve: Callable[..., str], redis_url: str
) -> None:
    url = serve(redis_url)
    # "hello" is 2 tokens by the estimate (5 bytes / 4, rounded up) + max_tokens 50
    first = completion(url, "k-tpm", max_tokens=50)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-tokens"] == "200"
    assert first.headers["x-ratelimit-remaining-tokens"] == str(200 - 52)  # as reserved
    second = completion(url, "k-tpm", max_tokens=50)  # the first was settled to its 7
    assert second.headers["x-ratelimit-remaining-tokens"] == str(200 - USED - 52)
    # a stream with a usage chunk settles the same way; so does one without: the gateway
    # asked the worker for its usage, and takes that chunk out for a client that did not
    streamed = completion(
        url, "k-tpm", max_tokens=50, stream=True, stream_options={"include_usage": True}
    )
    assert streamed.status_code == 200 and b'"total_tokens"' in streamed.content
    assert streamed.headers["x-ratelimit-remaining-tokens"] == str(200 - 2 * USED - 52)
    bare = completion(url, "k-tpm", max_tokens=50, stream=True)
    assert bare.headers["x-ratelimit-remaining-tokens"] == str(200 - 3 * USED - 52)
    assert bare.content == b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n'
    # bare was settled to its 7: 200 - 4*7 = 172 left; a request needing 173 does not fit
    refused = completion(url, "k-tpm", prompt="x" * 8, max_tokens=171)
    assert refused.status_code == 429
    assert "tokens per minute (tpm): limit 200" in refused.json()["error"]["message"]
    assert refused.headers["x-ratelimit-remaining-tokens"] == str(200 - 4 * USED)
    assert int(refused.headers["retry-after-ms"]) > 0
    # an error answer (a body the app refuses) gives its reservation back
    bad = completion(url, "k-tpm", max_tokens=50, stream="yes")
    assert bad.status_code == 400
    fits = completion(url, "k-tpm", prompt="x" * 8, max_tokens=170)
    assert fits.status_code == 200 and fits.headers["x-ratelimit-remaining-tokens"] == "0"


def test_a_request_larger_than_the_budget_is_not_retried(
    serve: Callable[..., str], redis_url: str
) -> None:
    url = serve(redis_url)
    r = completion(url, "k-tpm", max_tokens=500)
    assert r.status_code == 429 and r.headers["x-should-retry"] == "false"
    assert "Request too large" in r.json()["error"]["message"]
    assert "retry-after-ms" not in r.headers
    # nothing was counted for it
    ok = completion(url, "k-tpm", max_tokens=50)
    assert ok.headers["x-ratelimit-remaining-tokens"] == str(200 - 52)


def test_streams_without_a_session_are_limited_too(
    serve: Callable[..., str], redis_url: str
) -> None:
    url = serve(redis_url)
    free = completion(url, "k-free", stream=True)
    assert free.status_code == 200 and b"[DONE]" in free.content
    for _ in range(3):
        ok = completion(url, "k-rpm", stream=True)
        assert ok.status_code == 200 and b"[DONE]" in ok.content
        assert "x-ratelimit-remaining-requests" in ok.headers
    limited = completion(url, "k-rpm", stream=True)
    assert limited.status_code == 429
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_store_outage_fails_open_or_closed(
    serve: Callable[..., str], own_redis: RedisServer, mode: str
) -> None:
    url = serve(own_redis.url, rate_limit_on_store_error=mode)
    assert completion(url, "k-rpm").status_code == 200
    own_redis.stop()
    r = completion(url, "k-rpm")
    if mode == "open":
        assert r.status_code == 200 and "x-ratelimit-limit-requests" not in r.headers
    else:
        assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
    assert completion(url, "k-free").status_code == 200  # keys without limits: no store call
    text = httpx.get(f"{url}/metrics").text
    assert metric(text, f'ctxcache_gateway_rate_limit_store_errors_total{{outcome="{mode}"}}') == 1


def test_per_tenant_metrics_behind_their_token(serve: Callable[..., str], redis_url: str) -> None:
    off = serve(redis_url)
    r = httpx.get(f"{off}/metrics/tenants")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    url = serve(redis_url, metrics_token=METRICS_TOKEN)
    for _ in range(4):
        completion(url, "k-rpm")
    completion(url, "k-free", max_tokens=3)
    assert httpx.get(f"{url}/metrics/tenants").status_code == 401
    wrong = httpx.get(f"{url}/metrics/tenants", headers=auth("k-free"))
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    text = httpx.get(f"{url}/metrics/tenants", headers=auth(METRICS_TOKEN)).text
    assert metric(text, 'ctxcache_tenant_requests_total{tenant="acme"}') == 4
    assert metric(text, 'ctxcache_tenant_rate_limited_total{limit="requests",tenant="acme"}') == 1
    assert metric(text, 'ctxcache_tenant_tokens_total{tenant="acme"}') == 3 * USED
    assert metric(text, 'ctxcache_tenant_tokens_total{tenant="free"}') == USED
    public = httpx.get(f"{url}/metrics").text
    assert "acme" not in public and "tenant=" not in public


def test_hostile_bodies_on_a_limited_key_get_envelopes_never_a_500(
    serve: Callable[..., str], redis_url: str
) -> None:
    url = serve(redis_url, max_body_bytes=4096)
    headers = {**auth("k-both"), "content-type": "application/json"}
    cases: list[tuple[bytes, int, str]] = [
        (b"{not json", 400, "invalid_request"),
        (b"[1, 2, 3]", 400, "invalid_request"),
        (b'"text"', 400, "invalid_request"),
        (
            b'{"model": "m", "prompt": "x", "max_tokens": 1000000000000000000000000000000}',
            429,
            "rate_limit_exceeded",
        ),
        (b'{"model": "m", "prompt": "x", "max_tokens": 2000}', 429, "rate_limit_exceeded"),
        (b'{"model": "m", "prompt": "x", "n": 100, "max_tokens": 20}', 429, "rate_limit_exceeded"),
        (b'{"model": "m", "prompt": "x", "stream": "yes"}', 400, "invalid_request"),
        (b'{"model": "m", "prompt": "' + b"x" * 5000 + b'"}', 413, "request_too_large"),
        (b"", 400, "invalid_request"),
    ]
    for body, status, code in cases:
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/context"):
            r = httpx.post(f"{url}{path}", content=body, headers=headers, timeout=10)
            assert r.status_code < 500, (path, body[:60], r.status_code, r.text)
            if path == "/v1/completions":
                assert r.status_code == status, (body[:60], r.text)
                assert r.json()["error"]["code"] == code, body[:60]

    # a body sent in chunks (no Content-Length) is read ahead and replayed whole
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "m", '
        yield b'"prompt": "hello", "max_tokens": 10}'

    r = httpx.post(f"{url}/v1/completions", content=chunks(), headers=headers, timeout=10)
    assert r.status_code == 200 and r.headers["x-ratelimit-limit-tokens"] == "1000"
    # two Authorization headers name no key: the app's 401, nothing counted
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": "m", "prompt": "x"},
        headers=[("authorization", "Bearer k-both"), ("authorization", "Bearer k-rpm")],
    )
    assert r.status_code == 401 and "x-ratelimit-limit-requests" not in r.headers
