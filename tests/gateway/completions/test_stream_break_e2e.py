"""A streamed chat completion whose worker is `kill -9`ed mid-answer — a session turn and a
plain relayed stream — ends with OpenAI's error envelope as its last event (then the
connection is cut, no `[DONE]`): the openai SDK raises `APIError`, never a silent end. A
failed session turn leaves the session as it was. Real gateway, Redis and workers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from benchmarks.lib.process import Process
from tests.gateway.conftest import SDK
from tests.gateway.turns import test_failures_e2e as failures

doomed_worker = failures.doomed_worker  # (the fixture: a worker of its own, and a gateway)

AUTH = {"authorization": "Bearer key-a"}
ASK = [{"role": "user", "content": "Tell me everything."}]
KILL_AFTER = 3  # content chunks seen before the worker is killed


def extra(session_id: str | None) -> dict[str, Any]:
    """The body's fields beyond OpenAI's: a long answer (the worker dies long before its
    end), on the session if any."""
    fields: dict[str, Any] = {"ignore_eos": True}
    if session_id is not None:
        fields["session_id"] = session_id
    return fields


@pytest.fixture
def http(doomed_worker: tuple[Process, Process]) -> Iterator[httpx.Client]:
    """A client on the gateway in front of the doomed worker alone."""
    with httpx.Client(base_url=doomed_worker[1].url, headers=AUTH, timeout=120) as client:
        yield client


def new_session(http: httpx.Client) -> tuple[str, dict[str, Any]]:
    r = http.post(
        "/v1/context",
        json={"model": "tiny", "messages": [{"role": "system", "content": "Be thorough."}]},
    )
    assert r.status_code == 200, r.text
    sid = r.json()["session_id"]
    return sid, http.get(f"/v1/context/{sid}").json()


def raw_events(http: httpx.Client, worker: Process, session_id: str | None) -> list[bytes]:
    """The stream's events as the client got them, up to the cut connection (the worker is
    killed after `KILL_AFTER` content chunks)."""
    body = {"model": "tiny", "messages": ASK, "max_tokens": 3500, "stream": True}
    body.update(extra(session_id))
    got = b""
    with (
        pytest.raises(httpx.RemoteProtocolError),  # cut: never a complete-looking answer
        http.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for data in r.iter_bytes():
            got += data
            if got.count(b'"content"') >= KILL_AFTER:
                worker.kill()
    return [e for e in got.split(b"\n\n") if e]


def sdk_error(client: openai.OpenAI, worker: Process, session_id: str | None) -> Any:
    """The error the openai SDK raises while iterating the stream (the worker is killed
    after `KILL_AFTER` chunks)."""
    stream = client.chat.completions.create(
        model="tiny",
        messages=ASK,  # type: ignore[arg-type]
        max_tokens=3500,
        stream=True,
        extra_body=extra(session_id),
    )
    seen: list[Any] = []
    with pytest.raises(openai.APIError) as raised:
        for chunk in stream:
            seen.append(chunk)
            if len(seen) == KILL_AFTER:
                worker.kill()
    assert len(seen) >= KILL_AFTER
    return raised.value


def assert_ends_with_the_error(events: list[bytes]) -> None:
    assert len(events) > KILL_AFTER
    assert all(e.startswith(b"data: {") for e in events)  # no `[DONE]`
    *chunks, last = [orjson.loads(e[len(b"data: ") :]) for e in events]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert set(last) == {"error"}
    assert set(last["error"]) == {"message", "type", "param", "code"}
    assert last["error"]["code"] == "backend_unavailable"
    assert last["error"]["type"] == "server_error"
    assert "mid-answer" in last["error"]["message"]


def assert_unchanged(http: httpx.Client, sid: str, before: dict[str, Any]) -> None:
    """Nothing of the failed turn was appended, and its lock was given back: the next turn
    is not `session_busy` (it finds no worker left: the only one was killed)."""
    after = http.get(f"/v1/context/{sid}").json()
    assert (after["turns"], after["context_tokens"]) == (before["turns"], before["context_tokens"])
    body = {"model": "tiny", "messages": ASK, "max_tokens": 1, "session_id": sid}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 503 and r.json()["error"]["code"] == "backend_unavailable", r.text


def assert_raised_by_the_sdk(err: Any) -> None:
    # an `APIError` from the error event: not the cut connection (`APIConnectionError`)
    assert type(err) is openai.APIError, repr(err)
    assert err.code == "backend_unavailable" and err.type == "server_error"
    assert "mid-answer" in err.message


def test_a_session_turn_cut_mid_stream_ends_with_an_error_event(
    doomed_worker: tuple[Process, Process], http: httpx.Client
) -> None:
    sid, before = new_session(http)
    assert_ends_with_the_error(raw_events(http, doomed_worker[0], sid))
    assert_unchanged(http, sid, before)


def test_the_sdk_raises_a_session_turn_cut_mid_stream(
    doomed_worker: tuple[Process, Process], http: httpx.Client, sdk: SDK
) -> None:
    worker, g = doomed_worker
    sid, before = new_session(http)
    assert_raised_by_the_sdk(sdk_error(sdk(url=g.url), worker, sid))
    assert_unchanged(http, sid, before)


def test_a_relayed_stream_cut_mid_stream_ends_with_an_error_event(
    doomed_worker: tuple[Process, Process], http: httpx.Client
) -> None:
    assert_ends_with_the_error(raw_events(http, doomed_worker[0], None))


@pytest.mark.slow  # a worker of its own; the raw relayed case and the SDK's session case stay
def test_the_sdk_raises_a_relayed_stream_cut_mid_stream(
    doomed_worker: tuple[Process, Process], sdk: SDK
) -> None:
    worker, g = doomed_worker
    assert_raised_by_the_sdk(sdk_error(sdk(url=g.url), worker, None))
