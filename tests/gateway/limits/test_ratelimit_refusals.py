"""Rate limits never switch themselves off quietly, and never answer a 500.

* A Redis that refuses the count (OOM under noeviction, MISCONF, BUSY, NOPERM, READONLY on a
  demoted master) is a store error: `rate_limit_on_store_error` decides — `open` serves the
  request uncounted, `closed` answers `503 store_unavailable` — and
  `ctxcache_gateway_rate_limit_store_errors_total{outcome}` counts it. On a real
  redis-server of the test's own.
* A manager service that refuses the gateway (401: the manager token does not match; 404: a
  manager too old to have the limits route) is a misconfiguration, not an outage: limited
  keys get `503 store_unavailable` whatever the setting, an error-level log and
  `outcome="misconfigured"`. A real manager app on uvicorn, the gateway in process. Its
  session calls refused so are `503 store_unavailable` too, never the client's `401`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import httpx
import pytest
import uvicorn
from asgi_lifespan import LifespanManager
from starlette.routing import BaseRoute

from cache_manager.app import create_app as create_manager_app
from cache_manager.settings import ManagerSettings
from ctxcache.net import free_port
from ctxcache.redis_server import RedisServer
from ctxcache.settings import server_config
from gateway.app import create_app
from gateway.settings import GatewaySettings
from tests.cache_manager.refusals import KINDS, refusing, srv_fixture, url_of  # noqa: F401 (the srv fixture)
from tests.utils import metric

KEYS = {"k-limited": "acme:rpm=1000", "k-free": "free"}
LIMITED = {"authorization": "Bearer k-limited"}
ERRORS = "ctxcache_gateway_rate_limit_store_errors_total"

Gateway = Callable[..., AbstractAsyncContextManager[httpx.AsyncClient]]


@asynccontextmanager
async def _gateway(**settings: object) -> AsyncIterator[httpx.AsyncClient]:
    fields: dict[str, object] = {"api_keys": KEYS, "health_interval_s": 0.2, **settings}
    app = create_app(GatewaySettings(**fields))  # type: ignore[arg-type]
    async with LifespanManager(app) as running:
        transport = httpx.ASGITransport(app=running.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
            yield http


@pytest.fixture
def gateway() -> Gateway:
    """`async with gateway(**settings) as http`: a gateway in this process."""
    return _gateway


async def errors(http: httpx.AsyncClient, outcome: str) -> float:
    return metric((await http.get("/metrics")).text, f'{ERRORS}{{outcome="{outcome}"}}')


@pytest.mark.parametrize("kind", KINDS)
async def test_a_refusing_redis_fails_open_or_closed_as_set(
    gateway: Gateway, srv: RedisServer, kind: str
) -> None:
    url = url_of(srv)
    async with (
        gateway(redis_url=url, rate_limit_on_store_error="open") as open_,
        gateway(redis_url=url, rate_limit_on_store_error="closed") as closed,
    ):
        for http in (open_, closed):  # counted: the key's window is open
            r = await http.get("/v1/models", headers=LIMITED)
            assert r.status_code == 200 and "x-ratelimit-remaining-requests" in r.headers
        with refusing(srv, kind):
            served = await open_.get("/v1/models", headers=LIMITED)
            assert served.status_code == 200, served.text
            assert "x-ratelimit-remaining-requests" not in served.headers  # uncounted
            refused = await closed.get("/v1/models", headers=LIMITED)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "store_unavailable"
            assert "retry-after-ms" in refused.headers
            # a key without limits needs no store
            assert (
                await closed.get("/v1/models", headers={"authorization": "Bearer k-free"})
            ).status_code == 200
        assert await errors(open_, "open") == 1 and await errors(closed, "closed") == 1
        r = await closed.get("/v1/models", headers=LIMITED)  # counted again
        assert r.status_code == 200 and "x-ratelimit-remaining-requests" in r.headers


class Manager:
    """A real manager app on uvicorn in a thread; `routes` filters its routes."""

    def __init__(self, redis_url: str, token: str, keep: Callable[[BaseRoute], bool]) -> None:
        app = create_manager_app(ManagerSettings(redis_url=redis_url, token=token))
        app.router.routes = [r for r in app.router.routes if keep(r)]
        self.port = free_port()
        self.server = uvicorn.Server(server_config(app, host="127.0.0.1", port=self.port))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Manager:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "the manager did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def everything(_: BaseRoute) -> bool:
    return True


def no_limits_route(route: BaseRoute) -> bool:
    """An older manager: no `/ratelimits` routes."""
    return not getattr(route, "path", "").startswith("/ratelimits")


@pytest.mark.parametrize(
    ("token", "keep", "status"),
    [("not-the-managers", everything, "401"), ("the-token", no_limits_route, "404")],
    ids=["token-mismatch", "manager-without-limits"],
)
@pytest.mark.parametrize("mode", ["open", "closed"])
async def test_a_manager_that_refuses_the_gateway_is_loud(
    gateway: Gateway,
    redis_url: str,
    caplog: pytest.LogCaptureFixture,
    token: str,
    keep: Callable[[BaseRoute], bool],
    status: str,
    mode: str,
) -> None:
    with Manager(redis_url, "the-token", keep) as manager:
        async with gateway(
            manager_url=manager.url, manager_token=token, rate_limit_on_store_error=mode
        ) as http:
            with caplog.at_level(logging.ERROR, logger="gateway.ratelimit"):
                for _ in range(2):
                    r = await http.get("/v1/models", headers=LIMITED)
                    assert r.status_code == 503, r.text  # never served uncounted
                    assert r.json()["error"]["code"] == "store_unavailable"
                    assert "misconfigured" in r.json()["error"]["message"]
            assert await errors(http, "misconfigured") == 2
            assert await errors(http, mode) == 0  # not an outage
            said = [rec for rec in caplog.records if rec.name == "gateway.ratelimit"]
            assert said and all(rec.levelno == logging.ERROR for rec in said)
            assert status in said[0].getMessage()
            assert "not-the-managers" not in caplog.text  # (no token in a log line)
            # a key without limits does not ask the manager
            free = await http.get("/v1/models", headers={"authorization": "Bearer k-free"})
            assert free.status_code == 200


async def test_a_manager_that_refuses_the_gateway_is_a_503_for_sessions_too(
    gateway: Gateway, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Not only the limits route: a session call the manager refuses (401: the gateway's
    manager token is wrong) is the deployment's error, `503 store_unavailable` — never the
    `401 invalid_api_key` that would tell a client its own key is bad — and an error-level
    log line that names the setting, not the token. Its `/ready` is a 503 that says so
    (the manager's `/health` refuses a wrong token it is shown), so a misconfigured gateway
    never takes traffic; the manager's `/health` still answers a probe without a token."""
    free = {"authorization": "Bearer k-free"}
    with Manager(redis_url, "the-token", everything) as manager:
        async with gateway(manager_url=manager.url, manager_token="not-the-managers") as http:
            with caplog.at_level(logging.ERROR, logger="cache_manager.client"):
                listed = await http.get("/v1/context", headers=free)
                got = await http.get("/v1/context/ctx_" + "a" * 32, headers=free)
                dropped = await http.delete("/v1/context/ctx_" + "a" * 32, headers=free)
                ready = await http.get("/ready")  # (not ready: it says why)
            for r in (listed, got, dropped, ready):
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "store_unavailable"
                assert "misconfigured" in r.json()["error"]["message"]
            scraped = await http.get("/metrics")  # (its metrics still answer)
            assert scraped.status_code == 200
            assert metric(scraped.text, "ctxcache_gateway_store_up") == 0
            said = [rec for rec in caplog.records if rec.name == "cache_manager.client"]
            assert said and "CTX_GATEWAY_MANAGER_TOKEN" in said[0].getMessage()
            assert "not-the-managers" not in caplog.text
        async with gateway(manager_url=manager.url, manager_token="the-token") as http:
            assert (await http.get("/v1/context", headers=free)).status_code == 200
        async with httpx.AsyncClient() as probe:  # a probe without a token: still open
            assert (await probe.get(manager.url + "/health")).status_code == 200
