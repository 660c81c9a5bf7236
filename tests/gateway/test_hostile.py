"""Hostile input on every endpoint: the documented 4xx in the OpenAI envelope, never a 5xx,
and no session changes.

Each row of TABLE is one malformed or hostile request. Before the table, canary sessions
with a known history are created (a completion session with two turns, a chat session,
and one of another tenant); after every row they must read back exactly as before, and
after the whole table each must still take a turn (no turn lock was left behind).
docs/reliability.md lists the same classes with the answer each gets.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from benchmarks.lib.process import Process
from tests.gateway.conftest import Stack, aux_gateway

DOC = " ".join(f"Canary paragraph {i} keeps its history." for i in range(12))
OVER_WINDOW = "word " * 5000  # ~5000 tokens: over the tiny model's 4096-token window
DEEP = b"[" * 100_000 + b"]" * 100_000

# The error `type` each `code` carries (ctxcache/errors.py).
TYPES = {
    "invalid_request": "invalid_request_error",
    "invalid_ttl": "invalid_request_error",
    "context_length_exceeded": "invalid_request_error",
    "session_model_mismatch": "invalid_request_error",
    "session_not_found": "invalid_request_error",
    "model_not_found": "invalid_request_error",
    "not_found": "invalid_request_error",
    "method_not_allowed": "invalid_request_error",
    "request_too_large": "invalid_request_error",
    "invalid_api_key": "authentication_error",
}

# Placeholders filled in with the canaries' ids.
SID, CSID, BSID = "@SID@", "@CSID@", "@BSID@"


@dataclass(frozen=True)
class Case:
    method: str
    path: str
    body: bytes | dict[str, Any] | list[Any] | None = None
    expect: str = "400 invalid_request"  # status and error code
    headers: tuple[tuple[bytes, bytes], ...] = ()
    key: str | None = "key-a"  # None: no Authorization header


def row(name: str, method: str, path: str, body: Any = None, **kw: Any) -> Any:
    return pytest.param(Case(method, path, body, **kw), id=name)


def turn(extra: dict[str, Any] | None = None, *, chat: bool = False) -> dict[str, Any]:
    """A valid session turn on a canary, with `extra` merged in."""
    if chat:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "session_id": CSID}
    else:
        body = {"model": "tiny", "prompt": " x", "session_id": SID}
    return {**body, "max_tokens": 2, **(extra or {})}


def plain(extra: dict[str, Any] | None = None, *, chat: bool = False) -> dict[str, Any]:
    """A valid request without a session, with `extra` merged in."""
    body = turn(extra, chat=chat)
    del body["session_id"]
    return body


def create(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "x", **(extra or {})}


CTX, COMP, CHAT = "/v1/context", "/v1/completions", "/v1/chat/completions"
NF, SNF = "404 not_found", "404 session_not_found"
NO_MODEL, E405 = "404 model_not_found", "405 method_not_allowed"
TTL, TOO_LONG = "400 invalid_ttl", "400 context_length_exceeded"
MISMATCH, AUTH = "400 session_model_mismatch", "401 invalid_api_key"
JSON_HDR = ((b"content-type", b"application/json"),)

TABLE = [
    # --- POST /v1/context: bytes that are not a JSON object ---------------------------
    row("create-bad-json", "POST", CTX, b"{nope"),
    row("create-invalid-utf8", "POST", CTX, b'{"model":"tiny","prompt":"\xff\xfe"}'),
    row("create-lone-surrogate", "POST", CTX, b'{"model":"tiny","prompt":"a\\ud800b"}'),
    row(
        "create-lone-surrogate-in-metadata",
        "POST",
        CTX,
        b'{"model":"tiny","prompt":"a","metadata":{"k":"\\udfff"}}',
    ),
    row("create-nan-literal", "POST", CTX, b'{"model":"tiny","prompt":"a","max_tokens":NaN}'),
    row("create-empty-body", "POST", CTX, b""),
    row("create-json-array", "POST", CTX, [1, 2]),
    row("create-json-null", "POST", CTX, b"null"),
    row("create-deeply-nested", "POST", CTX, b'{"model":"tiny","prompt":"a","x":' + DEEP + b"}"),
    # --- POST /v1/context: wrong types and out-of-range numbers -----------------------
    row("create-ttl-string", "POST", CTX, create({"ttl": "soon"}), expect=TTL),
    row("create-ttl-bool", "POST", CTX, create({"ttl": True}), expect=TTL),
    row("create-ttl-fraction", "POST", CTX, create({"ttl": 1.5}), expect=TTL),
    row("create-ttl-negative", "POST", CTX, create({"ttl": -5}), expect=TTL),
    row("create-ttl-huge", "POST", CTX, create({"ttl": 10**30}), expect=TTL),
    row("create-max-tokens-negative", "POST", CTX, create({"max_tokens": -1})),
    row("create-max-tokens-bigint", "POST", CTX, create({"max_tokens": 10**30})),
    row(
        "create-max-tokens-over-window",
        "POST",
        CTX,
        create({"max_tokens": 10**9}),
        expect=TOO_LONG,
    ),
    row("create-n-5", "POST", CTX, create({"n": 5, "max_tokens": 1})),
    row("create-n-string", "POST", CTX, create({"n": "two"})),
    row("create-stream", "POST", CTX, create({"stream": True})),
    row("create-temperature-string", "POST", CTX, create({"temperature": "hot"})),
    row("create-model-empty", "POST", CTX, create({"model": ""})),
    row("create-model-huge", "POST", CTX, create({"model": "m" * 300})),
    row("create-model-int", "POST", CTX, create({"model": 7})),
    row(
        "create-unknown-model",
        "POST",
        CTX,
        create({"model": "gpt-9"}),
        expect=NO_MODEL,
    ),
    row(
        "create-prompt-and-messages",
        "POST",
        CTX,
        create({"messages": [{"role": "user", "content": "x"}]}),
    ),
    row("create-prompt-object", "POST", CTX, create({"prompt": {"a": 1}})),
    row("create-prompt-empty", "POST", CTX, create({"prompt": ""})),
    row("create-prompt-oov-ids", "POST", CTX, create({"prompt": [10**6]})),
    row("create-prompt-negative-ids", "POST", CTX, create({"prompt": [-1]})),
    row(
        "create-prompt-over-window",
        "POST",
        CTX,
        create({"prompt": OVER_WINDOW}),
        expect=TOO_LONG,
    ),
    row(
        "create-messages-bad-role",
        "POST",
        CTX,
        {"model": "tiny", "messages": [{"role": "root", "content": "x"}]},
    ),
    row(
        "create-messages-image-part",
        "POST",
        CTX,
        {
            "model": "tiny",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                }
            ],
        },
    ),
    row(
        "create-metadata-too-many",
        "POST",
        CTX,
        create({"metadata": {f"k{i}": "v" for i in range(17)}}),
    ),
    row("create-metadata-non-string", "POST", CTX, create({"metadata": {"k": 1}})),
    row("create-cache-salt-int", "POST", CTX, create({"cache_salt": 5})),
    # --- GET /v1/context (list) -------------------------------------------------------
    row("list-limit-zero", "GET", "/v1/context?limit=0"),
    row("list-limit-bigint", "GET", "/v1/context?limit=" + "9" * 30),
    row("list-limit-string", "GET", "/v1/context?limit=abc"),
    row("list-after-huge", "GET", "/v1/context?after=" + "a" * 1000),
    # --- GET /v1/context/{id}: ids of every shape ------------------------------------
    row("get-other-tenant", "GET", f"{CTX}/{BSID}", expect=SNF),
    row("get-huge-id", "GET", f"{CTX}/ctx_{'a' * 20_000}", expect=SNF),
    row("get-id-crlf", "GET", f"{CTX}/ctx_a%0d%0aX-Evil:%201", expect=SNF),
    row("get-id-nul", "GET", f"{CTX}/ctx_a%00", expect=SNF),
    row("get-id-invalid-utf8", "GET", f"{CTX}/ctx_%ff%fe", expect=SNF),
    row("get-id-surrogate-utf8", "GET", f"{CTX}/ctx_%ed%a0%80", expect=SNF),
    row("get-id-unicode", "GET", f"{CTX}/ctx_%C3%A9%F0%9F%98%80", expect=SNF),
    row("get-id-path-traversal", "GET", f"{CTX}/%2e%2e%2f%2e%2e%2fetc", expect=NF),
    row("get-id-extra-segment", "GET", f"{CTX}/{SID}/tokens", expect=NF),
    # --- PATCH /v1/context/{id} --------------------------------------------------------
    row("patch-bad-json", "PATCH", f"{CTX}/{SID}", b"{nope", headers=JSON_HDR),
    row("patch-ttl-string", "PATCH", f"{CTX}/{SID}", {"ttl": "soon"}, expect=TTL),
    row("patch-ttl-bool", "PATCH", f"{CTX}/{SID}", {"ttl": True}, expect=TTL),
    row("patch-ttl-huge", "PATCH", f"{CTX}/{SID}", {"ttl": 10**30}, expect=TTL),
    row("patch-not-an-object", "PATCH", f"{CTX}/{SID}", [1]),
    row("patch-other-tenant", "PATCH", f"{CTX}/{BSID}", {"ttl": 600}, expect=SNF),
    # --- DELETE /v1/context/{id} -------------------------------------------------------
    row("delete-other-tenant", "DELETE", f"{CTX}/{BSID}", expect=SNF),
    row("delete-huge-id", "DELETE", f"{CTX}/{'a' * 20_000}", expect=SNF),
    row("delete-id-crlf", "DELETE", f"{CTX}/ctx_a%0d%0a", expect=SNF),
    row("delete-collection", "DELETE", CTX, expect=E405),
    # --- POST /v1/completions without a session (the fast path) ------------------------
    row("completion-bad-json", "POST", COMP, b'{"model":"tiny",'),
    row("completion-lone-surrogate", "POST", COMP, b'{"model":"tiny","prompt":"\\ud800"}'),
    row("completion-max-tokens-negative", "POST", COMP, plain({"max_tokens": -1})),
    row(
        "completion-max-tokens-over-window",
        "POST",
        COMP,
        plain({"max_tokens": 10**9}),
        expect=TOO_LONG,
    ),
    row("completion-n-zero", "POST", COMP, plain({"n": 0})),
    row("completion-n-huge", "POST", COMP, plain({"n": 10**6})),
    row(
        "completion-prompt-over-window",
        "POST",
        COMP,
        plain({"prompt": OVER_WINDOW}),
        expect=TOO_LONG,
    ),
    row(
        "completion-unknown-model",
        "POST",
        COMP,
        plain({"model": "gpt-9"}),
        expect=NO_MODEL,
    ),
    row(
        "completion-stream-unknown-model",
        "POST",
        COMP,
        plain({"model": "gpt-9", "stream": True}),
        expect=NO_MODEL,
    ),
    row(
        "completion-stream-over-window",
        "POST",
        COMP,
        plain({"stream": True, "max_tokens": 5000}),
        expect=TOO_LONG,
    ),
    row("completion-stream-string", "POST", COMP, plain({"stream": "false"})),
    row("completion-cache-salt-empty", "POST", COMP, plain({"cache_salt": ""})),
    # --- POST /v1/completions on a session: bad bodies never touch it -----------------
    row(
        "turn-lone-surrogate-header-session",
        "POST",
        COMP,
        b'{"model":"tiny","prompt":"\\ud800"}',
        headers=((b"x-session-id", SID.encode()),),
    ),
    row("turn-max-tokens-negative", "POST", COMP, turn({"max_tokens": -1})),
    row("turn-max-tokens-fraction", "POST", COMP, turn({"max_tokens": 1.5})),
    row("turn-n-2", "POST", COMP, turn({"n": 2})),
    row("turn-n-bigint", "POST", COMP, turn({"n": 10**30})),
    row("turn-echo", "POST", COMP, turn({"echo": True})),
    row("turn-batch-prompt", "POST", COMP, turn({"prompt": ["a", "b"]})),
    row("turn-prompt-oov-ids", "POST", COMP, turn({"prompt": [10**6]})),
    row("turn-logit-bias", "POST", COMP, turn({"logit_bias": {"1": 5}})),
    row("turn-seed-bigint", "POST", COMP, turn({"seed": 2**64})),
    row(
        "turn-over-window",
        "POST",
        COMP,
        turn({"prompt": OVER_WINDOW}),
        expect=TOO_LONG,
    ),
    row("turn-model-mismatch", "POST", COMP, turn({"model": "gpt-9"}), expect=MISMATCH),
    row("turn-session-append-string", "POST", COMP, turn({"session_append": "no"})),
    row("turn-cache-salt-int", "POST", COMP, turn({"cache_salt": 5})),
    row("turn-stream-string", "POST", COMP, turn({"stream": "yes"})),
    row("turn-stream-options-string", "POST", COMP, turn({"stream": True, "stream_options": "x"})),
    row("turn-stream-prompt-oov-ids", "POST", COMP, turn({"stream": True, "prompt": [10**6]})),
    row("turn-stream-temperature-5", "POST", COMP, turn({"stream": True, "temperature": 5})),
    row(
        "turn-stream-over-window",
        "POST",
        COMP,
        turn({"stream": True, "max_tokens": 5000}),
        expect=TOO_LONG,
    ),
    row("turn-stream-cache-salt-int", "POST", COMP, turn({"stream": True, "cache_salt": 5})),
    # --- session ids of every shape ---------------------------------------------------
    row("session-id-int", "POST", COMP, turn({"session_id": 5})),
    row("session-id-empty", "POST", COMP, turn({"session_id": ""}), expect=SNF),
    row("session-id-huge", "POST", COMP, turn({"session_id": "ctx_" + "a" * 100_000})),
    row(
        "session-id-path-like",
        "POST",
        COMP,
        turn({"session_id": "../../sessions/x"}),
        expect=SNF,
    ),
    row(
        "session-id-crlf",
        "POST",
        COMP,
        turn({"session_id": SID + "\r\nX-Evil: 1"}),
        expect=SNF,
    ),
    row("session-id-nul", "POST", COMP, turn({"session_id": SID + "\x00"}), expect=SNF),
    row(
        "session-id-unicode",
        "POST",
        COMP,
        turn({"session_id": "ctx_" + "é" * 32}),
        expect=SNF,
    ),
    row("session-id-other-tenant", "POST", COMP, turn({"session_id": BSID}), expect=SNF),
    row(
        "session-id-header-latin1",
        "POST",
        COMP,
        plain(),
        headers=((b"x-session-id", b"ctx_\xe9\xff"),),
        expect=SNF,
    ),
    row(
        "session-id-header-query-chars",
        "POST",
        COMP,
        plain(),
        headers=((b"x-session-id", b"../x?tenant=tenant-b#"),),
        expect=SNF,
    ),
    row(
        "session-id-header-and-body-differ",
        "POST",
        COMP,
        turn(),
        headers=((b"x-session-id", BSID.encode()),),
    ),
    # --- POST /v1/chat/completions ----------------------------------------------------
    row(
        "chat-lone-surrogate",
        "POST",
        CHAT,
        b'{"model":"tiny","messages":[{"role":"user","content":"\\udfff"}]}',
    ),
    row("chat-messages-empty", "POST", CHAT, plain({"messages": []}, chat=True)),
    row("chat-messages-string", "POST", CHAT, plain({"messages": "hi"}, chat=True)),
    row(
        "chat-content-junk-part",
        "POST",
        CHAT,
        plain({"messages": [{"role": "user", "content": [{"x": 1}]}]}, chat=True),
    ),
    row(
        "chat-max-completion-tokens-over-window",
        "POST",
        CHAT,
        plain({"max_completion_tokens": 10**8, "max_tokens": None}, chat=True),
        expect=TOO_LONG,
    ),
    row(
        "chat-turn-bad-role",
        "POST",
        CHAT,
        turn({"messages": [{"role": "god", "content": "x"}]}, chat=True),
    ),
    row("chat-turn-tools", "POST", CHAT, turn({"tools": [{"type": "function"}]}, chat=True)),
    row("chat-turn-n-3", "POST", CHAT, turn({"n": 3}, chat=True)),
    row(
        "chat-turn-over-window",
        "POST",
        CHAT,
        turn({"messages": [{"role": "user", "content": OVER_WINDOW}]}, chat=True),
        expect=TOO_LONG,
    ),
    row("chat-turn-on-completion-session", "POST", CHAT, turn({"session_id": SID}, chat=True)),
    row("completion-turn-on-chat-session", "POST", COMP, turn({"session_id": CSID})),
    row(
        "chat-turn-stream-model-mismatch",
        "POST",
        CHAT,
        turn({"stream": True, "model": "other"}, chat=True),
        expect=MISMATCH,
    ),
    row(
        "chat-turn-stream-options-int",
        "POST",
        CHAT,
        turn({"stream": True, "stream_options": 5}, chat=True),
    ),
    row(
        "chat-turn-stream-logprobs",
        "POST",
        CHAT,
        turn({"stream": True, "logprobs": True}, chat=True),
    ),
    # --- auth header variants ---------------------------------------------------------
    row("auth-missing-get", "GET", f"{CTX}/{SID}", key=None, expect=AUTH),
    row(
        "auth-missing-delete",
        "DELETE",
        f"{CTX}/{SID}",
        key=None,
        expect=AUTH,
    ),
    row("auth-missing-turn", "POST", COMP, turn(), key=None, expect=AUTH),
    row(
        "auth-basic-scheme",
        "POST",
        COMP,
        plain(),
        key=None,
        expect=AUTH,
        headers=((b"authorization", b"Basic a2V5LWE6"),),
    ),
    row(
        "auth-bearer-without-key",
        "POST",
        CTX,
        create(),
        key=None,
        expect=AUTH,
        headers=((b"authorization", b"Bearer"),),
    ),
    row(
        "auth-tab-separator",
        "GET",
        CTX,
        key=None,
        expect=AUTH,
        headers=((b"authorization", b"Bearer\tkey-a"),),
    ),
    row(
        "auth-huge-key",
        "POST",
        COMP,
        plain(),
        key=None,
        expect=AUTH,
        headers=((b"authorization", b"Bearer " + b"k" * 60_000),),
    ),
    row(
        "auth-latin1-key",
        "GET",
        f"{CTX}/{SID}",
        key=None,
        expect=AUTH,
        headers=((b"authorization", b"Bearer key-\xe9"),),
    ),
    row(
        "auth-utf8-key",
        "POST",
        COMP,
        plain(),
        key=None,
        expect=AUTH,
        headers=((b"authorization", "Bearer key-é".encode()),),
    ),
    row(
        "auth-duplicated-fast-path",
        "POST",
        COMP,
        plain(),
        key=None,
        expect=AUTH,
        headers=((b"authorization", b"Bearer key-z"), (b"authorization", b"Bearer key-a")),
    ),
    row(
        "auth-duplicated-session-turn",
        "POST",
        COMP,
        turn(),
        key=None,
        expect=AUTH,
        headers=((b"authorization", b"Bearer key-a"), (b"authorization", b"Bearer key-b")),
    ),
    row("auth-other-tenant-delete", "DELETE", f"{CTX}/{SID}", key="key-b", expect=SNF),
    # --- routes and methods -----------------------------------------------------------
    row("models-post", "POST", "/v1/models", {}, expect=E405),
    row("completions-get", "GET", COMP, expect=E405),
    row("context-put", "PUT", f"{CTX}/{SID}", {"ttl": 60}, expect=E405),
    row("unknown-route", "POST", "/v1/engines/tiny/completions", {}, expect=NF),
]


@dataclass
class Canaries:
    ids: dict[str, str]  # placeholder -> session id
    keys: dict[str, str]  # placeholder -> the API key of its tenant
    before: dict[str, dict[str, Any]]

    def fill(self, value: Any) -> Any:
        if isinstance(value, str):
            for placeholder, sid in self.ids.items():
                value = value.replace(placeholder, sid)
            return value
        if isinstance(value, bytes):
            return self.fill(value.decode("latin-1")).encode("latin-1")
        if isinstance(value, dict):
            return {k: self.fill(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self.fill(v) for v in value)
        return value

    def read(self, http: httpx.Client) -> dict[str, dict[str, Any]]:
        out = {}
        for placeholder, sid in self.ids.items():
            r = http.get(
                f"/v1/context/{sid}", headers={"authorization": f"Bearer {self.keys[placeholder]}"}
            )
            assert r.status_code == 200, r.text
            # all but what the sidecar holds: that may still be filling from a prefill
            out[placeholder] = {
                k: v for k, v in r.json().items() if k not in ("kv_tokens", "kv_bytes")
            }
        return out


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def canaries(stack: Stack, http: httpx.Client) -> Canaries:
    a = {"authorization": "Bearer key-a"}
    r = http.post(CTX, headers=a, json={"model": "tiny", "prompt": DOC, "max_tokens": 0})
    assert r.status_code == 200, r.text
    sid = r.json()["session_id"]
    r = http.post(
        COMP,
        headers=a,
        json={"model": "tiny", "prompt": " and", "max_tokens": 3, "session_id": sid},
    )
    assert r.status_code == 200, r.text
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    r = http.post(CTX, headers=a, json=chat)
    assert r.status_code == 200, r.text
    csid = r.json()["session_id"]
    r = http.post(CTX, headers={"authorization": "Bearer key-b"}, json=create())
    assert r.status_code == 200, r.text
    c = Canaries(
        ids={SID: sid, CSID: csid, BSID: r.json()["session_id"]},
        keys={SID: "key-a", CSID: "key-a", BSID: "key-b"},
        before={},
    )
    c.before = c.read(http)
    assert c.before[SID]["turns"] == 2 and c.before[CSID]["turns"] == 1
    return c


def assert_envelope(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == code, err
    assert err["type"] == TYPES[code], err
    assert isinstance(err["message"], str) and err["message"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert "Traceback" not in err["message"]
    return err  # type: ignore[no-any-return]


def send(http: httpx.Client, canaries: Canaries, case: Case) -> httpx.Response:
    headers: list[tuple[bytes, bytes]] = []
    if case.key is not None:
        headers.append((b"authorization", f"Bearer {case.key}".encode()))
    content: bytes | None = None
    if case.body is not None:
        body = canaries.fill(case.body)
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers.append((b"content-type", b"application/json"))
    headers += canaries.fill(case.headers)
    return http.request(case.method, canaries.fill(case.path), content=content, headers=headers)


@pytest.mark.parametrize("case", TABLE)
def test_hostile_request(http: httpx.Client, canaries: Canaries, case: Case) -> None:
    r = send(http, canaries, case)
    status, code = case.expect.split()
    after = canaries.read(http)
    before, canaries.before = canaries.before, after  # one bad row fails alone
    assert after == before  # no session changed
    assert_envelope(r, int(status), code)


def test_the_table_is_big_enough() -> None:
    assert len(TABLE) >= 40


def test_canaries_still_take_turns(http: httpx.Client, canaries: Canaries) -> None:
    """After the table: no turn lock was left behind, and each session goes on normally."""
    assert canaries.read(http) == canaries.before
    a = {"authorization": "Bearer key-a"}
    for body in (turn(), turn(chat=True)):
        path = CHAT if "messages" in body else COMP
        r = http.post(path, headers=a, json=canaries.fill(body))
        assert r.status_code == 200, r.text
    after = canaries.read(http)
    assert after[SID]["turns"] == canaries.before[SID]["turns"] + 1
    assert after[CSID]["turns"] == canaries.before[CSID]["turns"] + 1
    assert after[BSID] == canaries.before[BSID]
    canaries.before = after


def raw_request(url: str, head: bytes, body: bytes = b"") -> bytes:
    """Send bytes no HTTP client would, and read the answer until the server closes."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head + body)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize(
    "header",
    [
        pytest.param(b"Authorization: Bearer key-a\x00", id="nul-in-authorization"),
        pytest.param(b"Authorization: Bearer key-a\x01", id="control-byte-in-authorization"),
        pytest.param(b"Authorization: Bearer key-a\rX-Evil: 1", id="lone-cr-in-authorization"),
        pytest.param(b"X-Session-Id: @SID@\nX-Evil: 1", id="lone-lf-in-session-header"),
        pytest.param(b"Authorization: Bearer\r\n key-a", id="obs-fold-authorization"),
        pytest.param(b"Content-Length: -5", id="negative-content-length"),
        pytest.param(b"Content-Length: " + b"9" * 30, id="bigint-content-length"),
    ],
)
def test_malformed_http_is_refused_before_the_app(
    stack: Stack, http: httpx.Client, canaries: Canaries, header: bytes
) -> None:
    """Bytes that are not HTTP (control bytes in a header, a broken Content-Length) are
    refused by the HTTP server itself: a plain 400 and a closed connection, never a 5xx."""
    body = json.dumps(canaries.fill(turn())).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\n"
    )
    if b"Content-Length" not in header:
        head += b"Content-Length: %d\r\n" % len(body)
    head += canaries.fill(header) + b"\r\n\r\n"
    answer = raw_request(stack.url, head, body)
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:300]
    assert canaries.read(http) == canaries.before


# --- bodies over the limit, on a gateway with a small one ----------------------------

LIMIT = 4096


@pytest.fixture(scope="module")
def small_gateway(stack: Stack) -> Iterator[Process]:
    workers = [f"{w.url}={stack.sidecar_url}" for w in stack.workers]
    gw = aux_gateway(
        stack, "gw-small-body", workers, stack.redis.url, CTX_GATEWAY_MAX_BODY_BYTES=str(LIMIT)
    )
    try:
        yield gw
    finally:
        gw.stop()


def chunked(data: bytes) -> Iterator[bytes]:
    """A body without Content-Length (chunked transfer), counted as it arrives."""
    for i in range(0, len(data), 1000):
        yield data[i : i + 1000]


PAD = "y" * (2 * LIMIT)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
@pytest.mark.parametrize(
    ("method", "path", "body", "headers"),
    [
        pytest.param("POST", CTX, create({"prompt": PAD}), {}, id="create"),
        pytest.param("POST", COMP, plain({"prompt": PAD}), {}, id="completion-fast-path"),
        pytest.param("POST", COMP, turn({"prompt": PAD}), {}, id="turn-body-session"),
        pytest.param(
            "POST", COMP, plain({"prompt": PAD}), {"x-session-id": SID}, id="turn-header-session"
        ),
        pytest.param(
            "POST",
            CHAT,
            turn({"stream": True, "messages": [{"role": "user", "content": PAD}]}, chat=True),
            {},
            id="chat-stream-turn",
        ),
        pytest.param("PATCH", f"{CTX}/{SID}", {"ttl": 600, "pad": PAD}, {}, id="patch"),
    ],
)
def test_body_over_the_limit_is_413(
    small_gateway: Process,
    http: httpx.Client,
    canaries: Canaries,
    framing: str,
    method: str,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
) -> None:
    data = json.dumps(canaries.fill(body)).encode()
    assert len(data) > LIMIT
    with httpx.Client(base_url=small_gateway.url, timeout=60) as small:
        r = small.request(
            method,
            canaries.fill(path),
            content=data if framing == "content-length" else chunked(data),
            headers={
                "authorization": "Bearer key-a",
                "content-type": "application/json",
                **canaries.fill(headers),
            },
        )
    assert_envelope(r, 413, "request_too_large")
    assert canaries.read(http) == canaries.before
