"""The real `ctxcache manager` process over HTTP: envelopes, auth, the same client."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from cache_manager.client import ManagerClient
from cache_manager.protocol import BeginTurn, CreateSession
from ctxcache.errors import ManagerRefused, SessionBusy, SessionNotFound
from tests.utils import ServiceProcess


@pytest.fixture
def manager_proc(redis_url: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    with ServiceProcess(
        ["manager", "--redis-url", redis_url, "--token", "s3cret"],
        log_path=tmp_path / "manager.log",
    ) as proc:
        yield proc


async def test_manager_process_speaks_the_envelope(manager_proc: ServiceProcess) -> None:
    async with httpx.AsyncClient(base_url=manager_proc.url) as http:
        r = await http.get("/health")
        assert r.status_code == 200
        r = await http.get("/health", headers={"authorization": "Bearer wrong"})
        assert r.status_code == 401  # open, but not to a wrong token: the gateway learns it
        r = await http.post("/sessions", json={"tenant": "a"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        auth = {"authorization": "Bearer s3cret"}
        r = await http.post("/sessions", json={"tenant": "a", "model": "m"}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        r = await http.post("/sessions", content=b"\xff{", headers=auth)
        assert r.status_code == 400
        r = await http.get("/sessions/ctx_" + "A" * 32, params={"tenant": "a"}, headers=auth)
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"

    bad = ManagerClient.over_http(manager_proc.url, token="wrong")
    with pytest.raises(ManagerRefused) as refused:  # the deployment's error, not a client's
        await bad.list("a")
    assert refused.value.status == 503 and refused.value.answered == 401
    await bad.aclose()

    client = ManagerClient.over_http(manager_proc.url, token="s3cret")
    try:
        info = await client.create(
            CreateSession(tenant="a", model="m", kind="completion", tokens=list(range(5000)))
        )
        state = await client.begin(info.session_id, BeginTurn(tenant="a"))
        assert state.tokens == list(range(5000))
        with pytest.raises(SessionBusy) as busy:
            await client.begin(info.session_id, BeginTurn(tenant="a"))
        assert busy.value.retry_after_ms > 0
        with pytest.raises(SessionNotFound):
            await client.get(info.session_id, "b")
    finally:
        await client.aclose()


async def test_turn_calls_check_the_token_and_body_too(manager_proc: ServiceProcess) -> None:
    """get/begin/append are served by the fast path: the same auth and envelopes."""
    sid = "ctx_" + "A" * 32
    async with httpx.AsyncClient(base_url=manager_proc.url) as http:
        for method, path, body in (
            ("GET", f"/sessions/{sid}?tenant=a", None),
            ("POST", f"/sessions/{sid}/begin", {"tenant": "a"}),
            ("POST", f"/sessions/{sid}/append", {"tenant": "a"}),
        ):
            r = await http.request(method, path, json=body)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        auth = {"authorization": "Bearer s3cret"}
        r = await http.post(f"/sessions/{sid}/begin", content=b"{bad", headers=auth)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        r = await http.post(f"/sessions/{sid}/append", json={"tenant": "a"}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "expected_version"
        r = await http.get(f"/sessions/{sid}", headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tenant"
        r = await http.post(f"/sessions/{sid}/begin", json={"tenant": "a"}, headers=auth)
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
