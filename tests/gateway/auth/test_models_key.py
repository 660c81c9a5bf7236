"""`GET /v1/models` needs no key, but a key it is shown must be valid (SPEC.md): a wrong or
revoked key gets OpenAI's `401 invalid_api_key` there as on every other route, so
`client.models.list()` checks a key as it does against OpenAI (issue 48)."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from asgi_lifespan import LifespanManager

from gateway.app import create_app
from gateway.settings import GatewaySettings


def write(path: Path, keys: dict[str, str]) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(keys))
    os.replace(tmp, path)
    return path


@asynccontextmanager
async def gateway(
    redis_url: str, keys_file: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, object]]:
    settings = GatewaySettings(redis_url=redis_url, api_keys_file=keys_file, api_keys_file_poll_s=0)  # type: ignore[call-arg]
    app = create_app(settings)
    async with LifespanManager(app) as running:
        transport = httpx.ASGITransport(app=running.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            yield http, app


def assert_invalid_key(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "authentication_error"
    assert set(error) == {"message", "type", "param", "code"}


async def test_models_refuses_a_wrong_or_revoked_key_and_serves_no_key(
    tmp_path: Path, redis_url: str
) -> None:
    keys = write(tmp_path / "keys.json", {"sk-kept": "acme", "sk-revoked": "acme"})
    async with gateway(redis_url, keys) as (http, app):

        async def models(authorization: str | None) -> httpx.Response:
            headers = {"authorization": authorization} if authorization is not None else {}
            return await http.get("/v1/models", headers=headers)

        assert (await models(None)).status_code == 200  # no key at all: open
        assert (await models("Bearer sk-kept")).status_code == 200
        assert (await models("Bearer sk-revoked")).status_code == 200  # (remembered as valid)
        for wrong in ("Bearer sk-wrong", "Bearer sk-kep", "Basic sk-kept", "Bearer "):
            assert_invalid_key(await models(wrong))

        write(keys, {"sk-kept": "acme"})  # sk-revoked is removed
        assert await app.state.keys.reload(keys)  # type: ignore[attr-defined]
        assert_invalid_key(await models("Bearer sk-revoked"))
        assert (await models("Bearer sk-kept")).status_code == 200
        assert (await models(None)).status_code == 200
