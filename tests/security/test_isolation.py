"""Security properties of a deployed stack, each checked against real processes.

The stack: our own Redis, a sidecar with a control-API token and an encrypted disk tier,
the manager as its own service with a token (and the sidecar's token to pin KV), one
tiny worker, and a gateway with two tenants' API keys. Nothing is given a host: every
service must bind 127.0.0.1 by default. The last test scans every process's log for the
secrets the run used.
"""

from __future__ import annotations

import base64
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.lib.process import Process
from benchmarks.lib.stack import Engine, Gateway, StackSettings, manager_service
from ctxcache.lmcache_keys import parse_key, session_key
from ctxcache.redis_server import RedisServer
from sidecar.client import KVClient
from tests.stacks import started

KEY_A, KEY_B = "sk-tenant-a-" + os.urandom(8).hex(), "sk-tenant-b-" + os.urandom(8).hex()
WRONG_KEY = "sk-wrong-" + os.urandom(8).hex()  # a caller's bad key must not be logged either
MANAGER_TOKEN = "mgr-" + os.urandom(12).hex()
SIDECAR_TOKEN = "sc-" + os.urandom(12).hex()
ENCRYPTION_KEY = base64.b64encode(os.urandom(32)).decode()
SECRETS = {
    "tenant-a key": KEY_A,
    "tenant-b key": KEY_B,
    "a rejected key": WRONG_KEY,
    "manager token": MANAGER_TOKEN,
    "sidecar token": SIDECAR_TOKEN,
    "disk encryption key": ENCRYPTION_KEY,
}
METADATA = {"owner": "alice-private-label"}
DOC = " ".join(f"Line {i} of a document both tenants happen to send." for i in range(30))


@dataclass
class SecureStack:
    root: Path
    redis: RedisServer
    procs: dict[str, Process] = field(default_factory=dict)  # by name: the runner's
    sidecar_data_port: int = 0
    session_ids: list[str] = field(default_factory=list)  # every id this run created

    @property
    def url(self) -> str:
        return self.procs["gateway"].url

    def client(self, key: str = KEY_A) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, timeout=60, headers={"authorization": f"Bearer {key}"}
        )

    def create(self, http: httpx.Client, **body: Any) -> dict[str, Any]:
        r = http.post("/v1/context", json={"model": "tiny", "prompt": DOC, **body})
        assert r.status_code == 200, r.text
        self.session_ids.append(r.json()["session_id"])
        return r.json()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[SecureStack]:
    """The stack, started by the one stack builder; every process logs to ROOT/NAME.log."""
    root = tmp_path_factory.mktemp("secure")
    s = SecureStack(root=root, redis=RedisServer(root / "redis"))
    s.redis.start()
    sidecar = ("--data-dir", str(root / "sidecar"), "--disk-bytes", str(1 << 28))
    sidecar_env = {"CTX_SIDECAR_TOKEN": SIDECAR_TOKEN, "CTX_SIDECAR_ENCRYPTION_KEY": ENCRYPTION_KEY}
    args = ("--threads", "1", "--chunk-size", "64")
    worker = Engine("builtin", "worker", args, tiny_model, store=True, startup_timeout=180)
    settings = StackSettings(
        s.redis.url, sidecar=sidecar, sidecar_env=sidecar_env, engines=(worker,)
    )
    try:
        with started(settings, root) as (builder, runner):
            stack = builder.stack
            assert stack.sidecar_lm is not None
            s.sidecar_data_port = int(stack.sidecar_lm.rsplit(":", 1)[1])
            env = {"CTX_MANAGER_SIDECAR_TOKEN": SIDECAR_TOKEN}
            builder.add(manager_service(s.redis.url, MANAGER_TOKEN, env=env))
            env = {
                "CTX_GATEWAY_MANAGER_TOKEN": MANAGER_TOKEN,
                "CTX_GATEWAY_HEALTH_INTERVAL_S": "0.5",
            }
            keys = {KEY_A: "tenant-a", KEY_B: "tenant-b"}
            gateway = Gateway(keys=keys, env=env, log_level=None, timeout=60.0)
            builder.gateway(gateway, ["--manager-url", stack.url("manager")])
            s.procs = runner.procs
            yield s
    finally:
        s.redis.stop()


def error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code, r.text
    return r.json()["error"]  # type: ignore[no-any-return]


def test_session_ids_are_unguessable(secure: SecureStack) -> None:
    with secure.client() as a:
        ids = [secure.create(a, prompt="x")["session_id"] for _ in range(12)]
    assert len(set(ids)) == len(ids)
    for sid in ids:  # ctx_ + 32 url-safe base64 characters: 192 random bits
        assert re.fullmatch(r"ctx_[A-Za-z0-9_-]{32}", sid), sid
    bodies = [sid[4:] for sid in ids]
    for i, x in enumerate(bodies):  # no shared stem, as a counter or a clock would give
        for y in bodies[i + 1 :]:
            assert x[:6] != y[:6] and x[-6:] != y[-6:]


def _turn(sid: str, kind: str = "completion", **extra: Any) -> tuple[str, dict[str, Any]]:
    if kind == "chat":
        msgs = [{"role": "user", "content": "hi"}]
        return "/v1/chat/completions", {
            "model": "tiny",
            "messages": msgs,
            "max_tokens": 2,
            "session_id": sid,
            **extra,
        }
    return "/v1/completions", {
        "model": "tiny",
        "prompt": " go",
        "max_tokens": 2,
        "session_id": sid,
        **extra,
    }


def _probe(http: httpx.Client, sid: str) -> list[httpx.Response]:
    """Every way a caller can name a session."""
    path, body = _turn(sid)
    chat_path, chat_body = _turn(sid, "chat")
    return [
        http.get(f"/v1/context/{sid}"),
        http.patch(f"/v1/context/{sid}", json={"ttl": 600}),
        http.post(path, json=body),
        http.post(path, json={**body, "session_append": False}),
        http.post(
            path,
            json={k: v for k, v in body.items() if k != "session_id"},
            headers={"x-session-id": sid},
        ),
        http.post(chat_path, json=chat_body),
        http.delete(f"/v1/context/{sid}"),
    ]


def test_another_tenants_session_is_indistinguishable_from_none(secure: SecureStack) -> None:
    with secure.client() as a, secure.client(KEY_B) as b:
        created = secure.create(a, metadata=METADATA)
        sid = created["session_id"]
        before = a.get(f"/v1/context/{sid}").json()
        unknown = "ctx_" + base64.urlsafe_b64encode(os.urandom(24)).decode()
        theirs, nobody = _probe(b, sid), _probe(b, unknown)
        for r_theirs, r_nobody in zip(theirs, nobody, strict=True):
            error(r_theirs, 404, "session_not_found")
            # byte for byte the answer for an id that never existed: nothing to probe
            assert r_theirs.content.replace(sid.encode(), b"<id>") == r_nobody.content.replace(
                unknown.encode(), b"<id>"
            )
            for leak in ("tenant-a", METADATA["owner"], "alice"):
                assert leak not in r_theirs.text
        listing = b.get("/v1/context")
        assert sid not in listing.text and "alice" not in listing.text
        # paging "after" someone else's id reveals nothing either
        assert (
            b.get("/v1/context", params={"after": sid}).json()
            == b.get("/v1/context", params={"after": unknown}).json()
        )
        assert a.get(f"/v1/context/{sid}").json() == before  # untouched by b


def test_metrics_carry_no_tenant_or_session(secure: SecureStack) -> None:
    with secure.client() as a, secure.client(KEY_B) as b:
        for http in (a, b):
            created = secure.create(http)
            path, body = _turn(created["session_id"])
            assert http.post(path, json=body).status_code == 200
    texts = {
        "gateway": httpx.get(f"{secure.url}/metrics").text,
        "worker": httpx.get(f"{secure.procs['worker'].url}/metrics").text,
        "sidecar": httpx.get(
            f"{secure.procs['sidecar'].url}/metrics",
            headers={"authorization": f"Bearer {SIDECAR_TOKEN}"},
        ).text,
    }
    assert "ctxcache_gateway_requests_total" in texts["gateway"]
    assert "ctxcache_sidecar" in texts["sidecar"]
    for name, text in texts.items():
        for needle in ("tenant-a", "tenant-b", *secure.session_ids):
            assert needle not in text, f"{name} /metrics names {needle}"
        for sid in secure.session_ids:
            assert session_key(sid) not in text, f"{name} /metrics names a session key"
        labels = set(re.findall(r"[{,]([a-z_]+)=", text))
        assert not labels & {"tenant", "session", "session_id", "key", "api_key"}, (name, labels)


def test_equal_prompts_of_two_tenants_get_separate_kv(secure: SecureStack) -> None:
    with secure.client() as a, secure.client(KEY_B) as b:
        sid_a = secure.create(a, prompt=DOC + " shared")["session_id"]
        sid_b = secure.create(b, prompt=DOC + " shared")["session_id"]
    with KVClient("127.0.0.1", secure.sidecar_data_port) as kv:
        keys = [parse_key(k) for k in kv.list_keys() if k]
    by_session: dict[str | None, set[int]] = {}
    for k in keys:
        by_session.setdefault(k.session, set()).add(k.chunk_hash)
    mine, theirs = by_session.get(session_key(sid_a)), by_session.get(session_key(sid_b))
    assert mine and theirs  # both sessions' KV reached the sidecar, under their own tags
    # every block is bound to one session by its tag: no key is shared, so a lookup for
    # one session can never return the other's block
    raw = [k.to_string() for k in keys]
    assert len(raw) == len(set(raw))
    for sid in (sid_a, sid_b):
        assert not any(sid in s for s in raw)  # keys carry a digest, never the id itself


def test_control_apis_require_their_tokens(secure: SecureStack) -> None:
    sidecar, manager = secure.procs["sidecar"].url, secure.procs["manager"].url
    for base, token, paths in (
        (sidecar, SIDECAR_TOKEN, ["/stats", "/metrics", "/sessions/abc"]),
        (manager, MANAGER_TOKEN, ["/stats", "/sessions?tenant=t", "/tenants/t/usage"]),
    ):
        assert httpx.get(f"{base}/health").status_code == 200  # liveness stays open
        for path in paths:
            for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": token}):
                err = error(httpx.get(base + path, headers=headers), 401, "invalid_api_key")
                assert token not in err["message"]
            ok = httpx.get(base + path, headers={"authorization": f"Bearer {token}"})
            assert ok.status_code == 200, (path, ok.text)
    r = httpx.delete(f"{sidecar}/sessions/abc")
    assert r.status_code == 401
    # the manager pins KV with the sidecar's token: a session's blocks are pinned
    with secure.client() as a:
        sid = secure.create(a)["session_id"]
    deadline = time.monotonic() + 30
    while True:  # the worker stores the create's blocks after it answered
        info = httpx.get(
            f"{sidecar}/sessions/{session_key(sid)}",
            headers={"authorization": f"Bearer {SIDECAR_TOKEN}"},
        ).json()
        if info["blocks"] > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert info["pinned"] is True and info["blocks"] > 0


def _listening(port: int) -> set[str]:
    """Local addresses listening on `port` (from /proc/net/tcp{,6})."""
    out: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            addr, st = fields[1], fields[3]
            host, _, hexport = addr.rpartition(":")
            if st == "0A" and int(hexport, 16) == port:
                out.add(host)
    return out


def test_services_bind_localhost_by_default(secure: SecureStack) -> None:
    from cache_manager.settings import ManagerSettings
    from gateway.settings import GatewaySettings
    from sidecar.settings import SidecarSettings
    from worker.settings import WorkerSettings

    for cls in (GatewaySettings, ManagerSettings, SidecarSettings):
        assert cls().host == "127.0.0.1", cls  # type: ignore[call-arg]
    assert WorkerSettings(model="m").host == "127.0.0.1"
    ports = {name: p.port for name, p in secure.procs.items()}
    ports["sidecar data"] = secure.sidecar_data_port
    for name, port in ports.items():  # none of the processes was given a host
        assert _listening(port) == {"0100007F"}, f"{name} listens on {_listening(port)}"


def test_request_body_limit(secure: SecureStack) -> None:
    big = b'{"model": "tiny", "prompt": "' + b"x" * (9 << 20) + b'"}'
    with secure.client() as a:
        sid = secure.create(a)["session_id"]

        def chunked() -> Iterator[bytes]:  # no content-length: counted as it arrives
            for i in range(0, len(big), 1 << 20):
                yield big[i : i + 1 << 20]

        for path, headers in (
            ("/v1/completions", {}),
            ("/v1/completions", {"x-session-id": sid}),
            ("/v1/context", {}),
        ):
            error(a.post(path, content=big, headers=headers), 413, "request_too_large")
            error(a.post(path, content=chunked(), headers=headers), 413, "request_too_large")
        assert a.get(f"/v1/context/{sid}").json()["turns"] == 1


def test_rejected_keys_are_not_echoed(secure: SecureStack) -> None:
    with secure.client(WRONG_KEY) as bad:
        plain = {"model": "tiny", "prompt": "x"}
        for r in (bad.get("/v1/context"), bad.post("/v1/completions", json=plain)):
            err = error(r, 401, "invalid_api_key")
            assert WRONG_KEY not in r.text and "sk-" not in err["message"]


def test_no_secret_in_any_log(secure: SecureStack) -> None:
    """Last in the module: every process has logged its start-up and the requests above."""
    logs = {p.name: p.read_text(errors="replace") for p in secure.root.glob("*.log")}
    logs["redis"] = (secure.root / "redis" / "redis.log").read_text(errors="replace")
    assert set(logs) >= {"gateway.log", "manager.log", "sidecar.log", "worker.log"}
    assert all(logs.values()), "a process logged nothing: the scan would prove nothing"
    for file, text in logs.items():
        for what, secret in SECRETS.items():
            assert secret not in text, f"{file} contains the {what}"
