"""`Idempotency-Key` where attempts of one key race the session's other turns, fail half-way
or meet a DELETE: the gateway in process on a real Redis, in front of a scripted engine
(a made-up tokenizer and a fixed answer), so that a test decides when a chain is busy.

* a `/v1/responses` whose first attempt forked (its chain was busy) is not run again on the
  chain once it is free: the retry answers the fork's response;
* a fork that failed after claiming its key gives the key back at once (not `409
  request_in_progress` for minutes);
* conversations' replays carry `idempotent-replayed: true`;
* the request's hash is over its JSON, not its bytes: a retry that serialises the same body
  otherwise (key order, spaces) is the same request;
* a create retried after its session was deleted does not make it again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
import redis.asyncio as aioredis
from asgi_lifespan import LifespanManager
from fastapi import FastAPI

from ctxcache.errors import StoreUnavailable
from gateway.app import create_app
from gateway.responses.protocol import parse_response_id
from gateway.settings import GatewaySettings
from tests.gateway.scripted import ScriptedWorker, answer

ROLES = {"system": 4, "user": 5, "assistant": 3}
SAID = "ok"  # every answer of the engine


def render(messages: list[dict[str, Any]], *, generation: bool, cont: bool = False) -> list[int]:
    """An append-only chat template: `1 role content 2` per message, `1 3` to generate."""
    ids: list[int] = []
    for i, m in enumerate(messages):
        ids += [1, ROLES.get(m["role"], 6), *str(m.get("content") or "").encode()]
        if not (cont and i == len(messages) - 1):
            ids.append(2)
    return ids + ([1, 3] if generation else [])


async def engine(_: asyncio.StreamReader, w: asyncio.StreamWriter, body: dict[str, Any]) -> None:
    """`/tokenize` (told by its fields) and `/v1/completions` (always `SAID`)."""
    if "add_generation_prompt" in body:
        gen, cont = body["add_generation_prompt"], body.get("continue_final_message", False)
        ids = render(body["messages"], generation=gen, cont=cont)
        out: dict[str, Any] = {"tokens": ids, "count": len(ids), "max_model_len": 4096}
    elif "add_special_tokens" in body:
        ids = list(str(body["prompt"]).encode())
        out = {"tokens": ids, "count": len(ids), "max_model_len": 4096}
    else:
        prompt = len(body.get("prompt") or [])
        out = {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "text": SAID,
                    "token_ids": list(SAID.encode()),
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 2, "total_tokens": prompt + 2},
        }
    w.write(answer(200, orjson.dumps(out)))


@pytest.fixture(scope="module")
def worker() -> ScriptedWorker:
    return ScriptedWorker(engine).start()


class Gateway:
    def __init__(self, http: httpx.AsyncClient, app: FastAPI, redis: aioredis.Redis) -> None:
        self.http, self.app, self.redis = http, app, redis

    async def respond(self, key: str | None = None, **body: Any) -> httpx.Response:
        headers = {"Idempotency-Key": key} if key is not None else None
        doc = {"model": "m", "max_output_tokens": 4, **body}
        return await self.http.post("/v1/responses", json=doc, headers=headers)

    async def version(self, session_id: str) -> int:
        return int(await self.redis.hget(f"ctx:{{{session_id}}}", "version") or 0)


@pytest.fixture
async def gw(worker: ScriptedWorker, redis_url: str) -> AsyncIterator[Gateway]:
    settings = GatewaySettings(
        redis_url=redis_url,
        workers=[{"id": "w0", "url": f"http://127.0.0.1:{worker.port}"}],  # type: ignore[list-item]
        api_keys={"key-a": "tenant-a"},  # type: ignore[arg-type]
        health_interval_s=0.2,
    )
    app = create_app(settings)
    async with LifespanManager(app) as running:
        transport = httpx.ASGITransport(app=running.app)
        headers = {"authorization": "Bearer key-a"}
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://gw", headers=headers) as http,
            aioredis.Redis.from_url(redis_url) as redis,
        ):
            deadline = time.monotonic() + 10
            while not (await http.get("/v1/models")).json()["data"]:
                assert time.monotonic() < deadline, "the worker was never healthy"
                await asyncio.sleep(0.05)
            yield Gateway(http, app, redis)


def session_of(response_id: str) -> str:
    parsed = parse_response_id(response_id)
    assert parsed is not None
    return parsed[0]


async def test_a_retry_finds_the_fork_its_first_attempt_made(gw: Gateway) -> None:
    first = await gw.respond(input="Hello.")
    assert first.status_code == 200, first.text
    chain = session_of(first.json()["id"])
    at = await gw.version(chain)
    # another turn holds the chain: the first attempt forks
    lock = f"ctx:{{{chain}}}:lock"
    await gw.redis.set(lock, "another-turn", px=60_000)
    body = {"input": "And then?", "previous_response_id": first.json()["id"]}
    forked = await gw.respond("k-fork", **body)
    assert forked.status_code == 200, forked.text
    assert session_of(forked.json()["id"]) != chain
    # that turn fails: the chain is free, still at the first response
    await gw.redis.delete(lock)
    again = await gw.respond("k-fork", **body)
    assert again.status_code == 200, again.text
    assert again.json()["id"] == forked.json()["id"]  # the fork's answer ...
    assert await gw.version(chain) == at  # ... and nothing written on the chain
    assert again.headers.get("idempotent-replayed") == "true"

    # the other way round: a first attempt that appended is found while the chain is busy
    appended = await gw.respond("k-append", **body)
    assert appended.status_code == 200 and session_of(appended.json()["id"]) == chain
    await gw.redis.set(lock, "another-turn", px=60_000)
    replay = await gw.respond("k-append", **body)
    assert replay.status_code == 200 and replay.json()["id"] == appended.json()["id"]
    assert replay.headers.get("idempotent-replayed") == "true"
    await gw.redis.delete(lock)
    # and once it is free: still the same answer, one turn on the chain
    free = await gw.respond("k-append", **body)
    assert free.status_code == 200, free.text
    assert free.json()["id"] == appended.json()["id"]
    assert await gw.version(chain) == at + 1


async def test_a_fork_that_failed_gives_its_key_back(
    gw: Gateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = await gw.respond(input="Hello.")
    nxt = await gw.respond(input="Next.", previous_response_id=first.json()["id"])
    assert nxt.status_code == 200, nxt.text  # the chain moved on: continuing `first` forks
    manager = gw.app.state.manager

    async def unavailable(*_: object, **__: object) -> None:
        raise StoreUnavailable("session store unavailable: ConnectionError")

    # sharing the parent's KV fails: the store is unavailable
    monkeypatch.setattr(manager, "update", unavailable)
    body = {"input": "Instead?", "previous_response_id": first.json()["id"]}
    failed = await gw.respond("k-share", **body)
    assert failed.status_code == 503, failed.text
    monkeypatch.undo()
    # the retry runs (it got `409 request_in_progress` while the claim was kept renewed)
    deadline = time.monotonic() + 2
    while (retry := await gw.respond("k-share", **body)).status_code == 409:
        assert retry.json()["error"]["code"] == "request_in_progress"
        assert time.monotonic() < deadline, "the failed attempt's claim is still held"
        await asyncio.sleep(0.05)
    assert retry.status_code == 200, retry.text
    assert "idempotent-replayed" not in retry.headers
    assert session_of(retry.json()["id"]) not in (session_of(first.json()["id"]),)


async def test_conversation_replays_say_so(gw: Gateway) -> None:
    key = {"Idempotency-Key": "k-conv"}
    made = await gw.http.post("/v1/conversations", json={"metadata": {"a": "b"}}, headers=key)
    again = await gw.http.post("/v1/conversations", json={"metadata": {"a": "b"}}, headers=key)
    assert made.status_code == again.status_code == 200
    assert "idempotent-replayed" not in made.headers
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.json() == made.json()
    items = {"items": [{"type": "message", "role": "user", "content": "hi"}]}
    path = f"/v1/conversations/{made.json()['id']}/items"
    key = {"Idempotency-Key": "k-items"}
    added = await gw.http.post(path, json=items, headers=key)
    added_again = await gw.http.post(path, json=items, headers=key)
    assert added.status_code == added_again.status_code == 200
    assert "idempotent-replayed" not in added.headers
    assert added_again.headers.get("idempotent-replayed") == "true"
    assert added_again.json() == added.json()
    listed = await gw.http.get(path)
    assert len(listed.json()["data"]) == 1  # added once


async def test_the_request_hash_is_over_the_json_not_its_bytes(gw: Gateway) -> None:
    key = {"Idempotency-Key": "k-json", "content-type": "application/json"}
    first = await gw.http.post(
        "/v1/conversations", content=b'{"metadata": {"a": "1", "b": "2"}}', headers=key
    )
    assert first.status_code == 200, first.text
    # the same body, serialised otherwise: the same request
    again = await gw.http.post(
        "/v1/conversations", content=b'{\n "metadata":{"b":"2",\t"a":"1"}}', headers=key
    )
    assert again.status_code == 200, again.text
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.json()["id"] == first.json()["id"]
    # another value is another request
    other = await gw.http.post(
        "/v1/conversations", content=b'{"metadata": {"a": "1", "b": "3"}}', headers=key
    )
    assert other.status_code == 409
    assert other.json()["error"]["code"] == "idempotency_key_reused"


async def test_a_create_retried_after_its_delete_makes_nothing(gw: Gateway) -> None:
    key = {"Idempotency-Key": "k-deleted"}
    made = await gw.http.post("/v1/conversations", json={}, headers=key)
    conv = made.json()["id"]
    assert (await gw.http.delete(f"/v1/conversations/{conv}")).status_code == 200
    again = await gw.http.post("/v1/conversations", json={}, headers=key)
    assert again.status_code == 409, again.text
    assert again.json()["error"]["code"] == "idempotency_key_reused"
    assert (await gw.http.get(f"/v1/conversations/{conv}")).status_code == 404
    # a response chain whose last response was deleted (its session with it): the same
    chain = await gw.respond("k-chain", input="Hello.")
    rid = chain.json()["id"]
    assert (await gw.http.delete(f"/v1/responses/{rid}")).status_code == 200
    retried = await gw.respond("k-chain", input="Hello.")
    assert retried.status_code == 409 and "deleted" in retried.json()["error"]["message"]
    assert (await gw.http.get(f"/v1/responses/{rid}")).status_code == 404
