"""Control API in process: pins, info, delete, stats, metrics, auth, error envelope."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from asgi_lifespan import LifespanManager

from ctxcache.errors import InvalidAPIKey
from sidecar.app import create_app
from sidecar.client import KVClient
from sidecar.control_client import SidecarControl
from sidecar.service import Sidecar
from sidecar.settings import SidecarSettings

TOKEN = "s3cret-token"


@pytest.fixture
async def api() -> AsyncIterator[tuple[httpx.AsyncClient, Sidecar]]:
    app = create_app(SidecarSettings(port=0, memory_bytes=64 << 20, token=TOKEN))
    async with LifespanManager(app) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(
            transport=transport, base_url="http://sidecar", headers=headers
        ) as http:
            yield http, app.state.sidecar


def put_blocks(sc: Sidecar, session: str, n: int, size: int = 1000) -> None:
    with KVClient("127.0.0.1", sc.port) as c:
        for i in range(n):
            c.put(
                f"m@1@0@{i:x}@half@s%{session}",
                bytes(size),
                fmt=1,
                dtype=2,
                shape=(size // 2, 0, 0, 0),
            )
        # PUT has no reply; a request after it on the same connection is a barrier
        assert c.exists(f"m@1@0@{n - 1:x}@half@s%{session}")


async def test_unknown_session_reports_zero(api: tuple[httpx.AsyncClient, Sidecar]) -> None:
    http, _ = api
    r = await http.get("/sessions/nobody")
    assert r.status_code == 200
    assert r.json() == {
        "session": "nobody",
        "blocks": 0,
        "bytes": 0,
        "tokens": 0,
        "pinned": False,
        "expires_at": None,
    }


async def test_pin_info_delete(api: tuple[httpx.AsyncClient, Sidecar]) -> None:
    http, sc = api
    put_blocks(sc, "abc", 3)
    exp = time.time() + 600
    r = await http.put("/sessions/abc", json={"expires_at": exp})
    assert r.status_code == 200
    assert r.json() == {
        "session": "abc",
        "blocks": 3,
        "bytes": 3000,
        "tokens": 0,  # the blocks are not KV_2LTD: no tokens to count
        "pinned": True,
        "expires_at": exp,
    }
    stats = (await http.get("/stats")).json()
    assert stats["pinned_bytes"] == 3000 and stats["blocks"] == 3
    r = await http.delete("/sessions/abc")
    assert r.json() == {"session": "abc", "deleted": True, "blocks": 3, "bytes": 3000}
    assert (await http.get("/sessions/abc")).json()["bytes"] == 0
    with KVClient("127.0.0.1", sc.port) as c:
        assert c.get("m@1@0@0@half@s%abc") is None


async def test_expired_session_dropped_by_the_sidecar(
    api: tuple[httpx.AsyncClient, Sidecar],
) -> None:
    http, sc = api
    before = (await http.get("/stats")).json()["memory_bytes_used"]
    await http.put("/sessions/short", json={"expires_at": time.time() + 60})
    put_blocks(sc, "short", 4)
    assert (await http.get("/sessions/short")).json()["blocks"] == 4
    # the pin is moved to just ahead; the reaper, not a request, must drop the blocks
    await http.put("/sessions/short", json={"expires_at": time.time() + 0.3})
    for _ in range(100):  # the reaper sweeps every second
        if (await http.get("/sessions/short")).json()["blocks"] == 0:
            break
        await asyncio.sleep(0.1)
    assert (await http.get("/sessions/short")).json()["bytes"] == 0
    assert (await http.get("/stats")).json()["memory_bytes_used"] == before


async def test_metrics_exposition(api: tuple[httpx.AsyncClient, Sidecar]) -> None:
    http, sc = api
    put_blocks(sc, "m", 2)
    r = await http.get("/metrics")
    assert r.status_code == 200
    assert 'ctxcache_sidecar_requests_total{command="put"} 2.0' in r.text
    assert "ctxcache_sidecar_memory_bytes_used 2000.0" in r.text


@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {TOKEN}", TOKEN])
async def test_control_api_requires_token(
    api: tuple[httpx.AsyncClient, Sidecar], header: str | None
) -> None:
    http, _ = api
    headers = {"Authorization": header} if header else {}
    for method, path in [
        ("GET", "/sessions/x"),
        ("PUT", "/sessions/x"),
        ("DELETE", "/sessions/x"),
        ("GET", "/stats"),
        ("GET", "/metrics"),
    ]:
        req = http.build_request(method, path, json={"expires_at": 1.0})
        if header:
            req.headers["Authorization"] = header
        else:
            del req.headers["Authorization"]
        r = await http.send(req)
        assert r.status_code == 401, (method, path)
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert (await http.get("/health", headers=headers)).status_code == 200


async def test_bad_body_is_an_openai_error(api: tuple[httpx.AsyncClient, Sidecar]) -> None:
    http, _ = api
    for body in ({"expires_at": "soon"}, {}, {"expires_at": 1, "extra": 2}):
        r = await http.put("/sessions/x", json=body)
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "invalid_request"
    r = await http.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


async def test_control_client(api: tuple[httpx.AsyncClient, Sidecar]) -> None:
    http, sc = api
    put_blocks(sc, "cc", 2)
    control = SidecarControl("http://sidecar", token=TOKEN, client=http)
    assert (await control.pin("cc", time.time() + 60))["pinned"] is True
    assert (await control.info("cc"))["blocks"] == 2
    assert (await control.stats())["pinned_bytes"] == 2000
    assert (await control.drop("cc"))["blocks"] == 2
    assert (await control.info("cc"))["bytes"] == 0
    with pytest.raises(InvalidAPIKey):
        await SidecarControl("http://sidecar", token="bad", client=http).info("cc")
