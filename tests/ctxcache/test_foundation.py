"""The shared pieces: error envelope mapping, Redis launcher, CLI wiring."""

from __future__ import annotations

import subprocess
import sys

import pytest
import redis
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from ctxcache import errors
from ctxcache.cli import build_parser
from ctxcache.redis_server import RedisServer


class Body(BaseModel):
    ttl: int
    name: str


def _app() -> FastAPI:
    app = FastAPI()
    errors.install_error_handlers(app)

    @app.post("/echo")
    async def echo(body: Body) -> dict[str, str]:
        return {"name": body.name}

    @app.get("/busy")
    async def busy() -> None:
        raise errors.SessionBusy(retry_after_ms=120)

    @app.get("/crash")
    async def crash() -> None:
        raise RuntimeError("boom")

    return app


def test_every_error_is_an_openai_envelope() -> None:
    client = TestClient(_app(), raise_server_exceptions=False)
    r = client.post("/echo", content=b"{not json")
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_request"
    r = client.post("/echo", json={"ttl": "soon", "name": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_ttl"
    assert r.json()["error"]["param"] == "ttl"
    r = client.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = client.get("/busy")
    assert r.status_code == 409 and r.headers["retry-after-ms"] == "120"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = client.get("/crash")
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert "boom" not in r.text  # no internals leak to clients


def test_envelope_round_trips_into_the_same_exception() -> None:
    for exc in (errors.SessionNotFound(), errors.QuotaExceeded("too many"), errors.SessionBusy()):
        back = errors.error_from_envelope(exc.status, exc.envelope())
        assert type(back) is type(exc) and back.message == exc.message
    assert type(errors.error_from_envelope(500, {"nope": 1})) is errors.CtxError


def test_redis_server_starts_persists_with_aof_and_stops(tmp_path) -> None:
    server = RedisServer(tmp_path).start()
    r = redis.Redis(port=server.port)
    r.set("k", "v")
    r.close()
    server.stop(kill=False)
    server.start()
    r = redis.Redis(port=server.port)
    assert r.get("k") == b"v"
    r.close()
    server.stop()
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=server.port, socket_connect_timeout=0.2).ping()


def test_cli_lists_the_contract_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ctxcache.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for name in ("serve", "manager"):
        assert name in out
    assert build_parser().parse_args(["manager", "--port", "9999"]).port == 9999


def test_lmcache_keys_round_trip_including_layerwise() -> None:
    from ctxcache.lmcache_keys import parse_key, session_key, tags_from_params

    tags = tags_from_params({"lmcache.tag.s": session_key("ctx_x"), "other": 1})
    key = "tiny@1@0@1f@float@s%" + session_key("ctx_x")
    parsed = parse_key(key)
    assert parsed.to_string() == key and parsed.session == session_key("ctx_x")
    assert parsed.tags == tags and parsed.layer is None
    layered = parse_key("m@2@1@abc@half@7@s%k")
    assert (layered.layer, layered.session) == (7, "k")
    assert layered.to_string() == "m@2@1@abc@half@7@s%k"
    with pytest.raises(ValueError):
        parse_key("m@1@0@1f")
