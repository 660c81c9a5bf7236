"""What a `tpm` key is charged (docs/limits.md, "What counts"), on the gateway as `ctxcache
gateway` serves it, in front of a scripted worker whose answers (their usage, their timing,
where their bytes break) each request chooses through fields of its own body (`x_*`: the
gateway passes a body without a session on as it is):

- a reservation counts every prompt of a batch, `n` as the engine reads it, and the largest
  maximum the engine may honour;
- a stream is asked for its usage, which the client gets only if it asked (every other byte
  as the worker sent it), and is charged it;
- a stream cut off (its client left, its worker dropped) pays its prompt and the tokens
  relayed until then; a request whose client left before its answer keeps its reservation;
  one the worker refused pays nothing;
- a settlement that comes after its window ended is counted in the next window.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest

from gateway.completions.streams import UsageTap
from gateway.metering import EngineCall, State
from tests.gateway.rawhttp import chunk
from tests.gateway.scripted import Gateways, ScriptedWorker, answer

TPM = 1000
KEYS = {"k-tpm": f"acme:tpm={TPM}"}
AUTH = {"authorization": "Bearer k-tpm"}
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def usage_of(body: dict) -> dict:
    total = int(body.get("x_usage", 7))
    return {"prompt_tokens": 2, "completion_tokens": total - 2, "total_tokens": total}


def events_for(body: dict) -> list[bytes]:
    """A stream's events: `x_tokens` token chunks, the usage chunk if asked, `[DONE]`."""
    events = [
        b'data: {"id":"c","choices":[{"index":0,"text":"t%d"}]}\n\n' % i
        for i in range(int(body.get("x_tokens", 3)))
    ]
    if (body.get("stream_options") or {}).get("include_usage"):
        usage = orjson.dumps({"id": "c", "choices": [], "usage": usage_of(body)})
        events.append(b"data: " + usage + b"\n\n")
    return [*events, b"data: [DONE]\n\n"]


async def reply(r: asyncio.StreamReader, w: asyncio.StreamWriter, body: dict) -> None:
    await asyncio.sleep(float(body.get("x_delay", 0)))
    if body.get("x_refuse"):
        w.write(answer(400, b'{"error": {"message": "no", "type": "BadRequestError"}}'))
        return
    if not body.get("stream"):
        doc = {"object": "text_completion", "choices": [], "usage": usage_of(body)}
        w.write(answer(200, orjson.dumps(doc)))
        return
    whole = b"".join(chunk(e) for e in events_for(body))
    cut = body.get("x_cut")  # "stall" | "drop": after the tokens, no usage, no [DONE]
    if cut:
        whole = b"".join(chunk(e) for e in events_for(body)[: int(body["x_tokens"])])
    piece = int(body.get("x_piece", 0)) or len(whole)  # writes of this many bytes
    w.write(HEAD)
    for i in range(0, len(whole), piece):
        w.write(whole[i : i + piece])
        await w.drain()
        await asyncio.sleep(0.001)
    if cut == "stall":
        await r.read()  # until the gateway closes the connection
        raise ConnectionError("the gateway left")
    if cut == "drop":
        w.transport.abort()
        raise ConnectionError("dropped")
    w.write(b"0\r\n\r\n")


@pytest.fixture
def worker() -> ScriptedWorker:
    return ScriptedWorker(reply).start()


@pytest.fixture
def serve(redis_url: str, worker: ScriptedWorker) -> Iterator[Callable[..., str]]:
    gateways = Gateways()

    def start(**settings: object) -> str:
        return gateways.start(
            AUTH,
            redis_url=redis_url,
            workers=[f"http://127.0.0.1:{worker.port}"],
            api_keys=KEYS,
            health_interval_s=0.2,
            **{"rate_limit_window_s": 60, **settings},
        )

    yield start
    gateways.close()


def post(url: str, path: str = "/v1/completions", **body: object) -> httpx.Response:
    doc = {"model": "m", "prompt": "hello", "max_tokens": 10, **body}  # reserves 2 + 10
    return httpx.post(f"{url}{path}", json=doc, headers=AUTH, timeout=10)


def left(r: httpx.Response) -> int:
    return int(r.headers["x-ratelimit-remaining-tokens"])


def charged(url: str, expected: int, since: int = TPM) -> int:
    """The tokens charged since the budget was `since`, as probes (each reserving 12 and
    paying 12) show them, polled until they are `expected` (a settlement runs as its
    request's task ends, just after the client has its answer)."""
    deadline = time.monotonic() + 5
    probes = 0
    while True:
        probe = post(url, x_usage=12)
        assert probe.status_code == 200
        probes += 1
        got = since - left(probe) - 12 * probes
        if got == expected or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def budget(url: str) -> int:
    """The tokens left once a probe (reserving and paying 12) has run."""
    return left(post(url, x_usage=12))


@pytest.mark.parametrize(
    ("path", "body", "reserved"),
    [
        # a batch: each prompt estimated, each with n answers of max_tokens
        ("/v1/completions", {"prompt": ["hello", "world!!"], "n": 3}, 2 + 2 + 2 * 3 * 10),
        ("/v1/completions", {"prompt": [[1, 2, 3], [4, 5]], "n": 2}, 5 + 2 * 2 * 10),
        # n past the gateway's own 1..128: the engine generates them all
        ("/v1/completions", {"n": 129, "max_tokens": 5}, 2 + 129 * 5),
        ("/v1/completions", {"n": "3"}, 2 + 3 * 10),  # (the engine reads "3" as 3)
        # chat: vLLM honours max_completion_tokens, ctxcache's worker max_tokens: the larger
        (  # (the messages' JSON: 32 bytes)
            "/v1/chat/completions",
            {
                "prompt": None,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
                "max_completion_tokens": 400,
            },
            8 + 400,
        ),
    ],
)
def test_a_reservation_counts_what_the_engine_may_generate(
    serve: Callable[..., str], path: str, body: dict, reserved: int
) -> None:
    url = serve()
    r = post(url, path, x_refuse=True, **body)  # (refused by the worker: nothing charged)
    assert r.status_code == 400
    assert left(r) == TPM - reserved
    assert charged(url, 0) == 0


def test_n_and_the_maximum_count_as_the_engine_reads_them(serve: Callable[..., str]) -> None:
    url = serve()
    r = post(url, n=1000)  # 2 + 1000 * 10: past the whole budget (today's code: n as 1)
    assert r.status_code == 429 and r.headers["x-should-retry"] == "false"
    r = post(url, n=0, x_refuse=True)  # an n the engine refuses: as 1
    assert left(r) == TPM - 12
    # /v1/completions takes only max_tokens (vLLM ignores max_completion_tokens there)
    r = post(url, max_completion_tokens=400, x_refuse=True)
    assert left(r) == TPM - 12


@pytest.mark.parametrize("piece", [0, 1, 7])
def test_a_stream_is_charged_the_usage_it_did_not_ask_for(
    serve: Callable[..., str], worker: ScriptedWorker, piece: int
) -> None:
    """The gateway asks the worker for the stream's usage, charges it, and takes the usage
    chunk out for a client that did not ask: the client gets every other byte as the
    worker sent it, however the worker's writes break the events."""
    url = serve()
    r = post(url, stream=True, x_usage=300, x_piece=piece)
    assert r.status_code == 200
    assert worker.requests[-1]["stream_options"] == {"include_usage": True}
    assert r.content == b"".join(events_for({"x_tokens": 3}))  # without the usage chunk
    assert charged(url, 300) == 300

    # a client that asked gets the worker's usage chunk, and the same charge
    since = budget(url)
    r = post(url, stream=True, x_usage=200, x_piece=piece, stream_options={"include_usage": True})
    body = {"x_tokens": 3, "x_usage": 200, "stream_options": {"include_usage": True}}
    assert r.content == b"".join(events_for(body))
    assert charged(url, 200, since) == 200

    # usage in every chunk was not what a client without include_usage asked for
    post(url, stream=True, stream_options={"continuous_usage_stats": True, "include_usage": None})
    assert worker.requests[-1]["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("cut", ["stall", "drop"])
def test_a_cut_stream_pays_its_prompt_and_what_was_relayed(
    serve: Callable[..., str], cut: str
) -> None:
    """Reserved 2 + 100; the worker sent 5 tokens, then stalled (its client leaves) or
    dropped its connection (the client reads the cut answer to its end): no usage came, it
    pays 2 + 5. (Today's code charged the stream its reservation.)"""
    url = serve()
    body = {"model": "m", "prompt": "hello", "max_tokens": 100, "stream": True}
    body.update(x_tokens=5, x_cut=cut)
    tokens = 0
    with (
        httpx.Client(timeout=10) as http,
        http.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as r,
        contextlib.suppress(httpx.RemoteProtocolError),  # (a cut answer: its end is cut)
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            tokens += line.startswith('data: {"id"')
            if tokens == 5 and cut == "stall":
                break  # hangs up
    assert tokens == 5
    assert charged(url, 2 + 5) == 2 + 5


def test_a_request_whose_client_left_keeps_its_reservation(serve: Callable[..., str]) -> None:
    """The engine got it and says nothing of what it did: the reservation is the best
    guess (today's code gave it back)."""
    url = serve()
    doc = {"model": "m", "prompt": "hello", "max_tokens": 10, "x_delay": 1.0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=doc, headers=AUTH, timeout=0.3)
    time.sleep(1.0)
    assert charged(url, 12) == 12


def late(url: str, usage: int, delay: float) -> threading.Thread:
    """A request (reserving 12) that answers after `delay` seconds, with `usage`."""
    thread = threading.Thread(target=post, args=(url,), kwargs={"x_usage": usage, "x_delay": delay})
    thread.start()
    return thread


def test_a_late_charge_counts_in_the_window_open_then(serve: Callable[..., str]) -> None:
    """A request outlives its window (2 s); meanwhile another opened the next: what it used
    beyond its reservation (150 - 12) counts there. Today's code dropped it."""
    url = serve(rate_limit_window_s=2.0)
    first = post(url, x_usage=12)  # opens the window
    slow = late(url, 150, 2.6)
    reset = first.headers["x-ratelimit-reset-tokens"]  # ("1.998s", or "950ms")
    time.sleep((float(reset[:-2]) / 1000 if reset.endswith("ms") else float(reset[:-1])) + 0.1)
    opener = post(url, x_usage=12)  # its window has ended: this opens the next, pays 12
    assert left(opener) == TPM - 12
    slow.join()
    time.sleep(0.1)
    probe = post(url, x_usage=12)
    assert left(probe) == TPM - 12 - (150 - 12) - 12


def test_a_late_charge_opens_a_window_if_none_is(serve: Callable[..., str]) -> None:
    """No window open when the late charge comes: it opens one, charged; a late refund
    (a request that used less than it reserved) is dropped, its window being gone."""
    url = serve(rate_limit_window_s=1.0)
    late(url, 150, 1.3).join()
    probe = post(url, x_usage=12)
    assert left(probe) == TPM - (150 - 12) - 12
    time.sleep(1.1)  # that window ends too
    late(url, 3, 1.3).join()  # used 3 of its 12: nothing to give back in a window now gone
    probe = post(url, x_usage=12)
    assert left(probe) == TPM - 12


@pytest.mark.parametrize("drop", [False, True])
def test_the_tap_passes_every_byte_but_the_usage_chunk_however_they_break(drop: bool) -> None:
    """`UsageTap` on its own: the worker's bytes cut at every place, a comment line, an event
    without its last blank line: the client's bytes are the worker's (less the usage chunk
    when dropping), and the usage and the tokens are counted once."""
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":2,"total_tokens":9}}\n\n'
    events = [b'data: {"choices":[{"text":"a"}]}\n\n', b": keep-alive\n\n"]
    events += [b'data: {"choices":[{"text":"b"}]}\n\n', usage, b"data: [DONE]"]
    stream = b"".join(events)
    for cut in range(1, len(stream)):
        call = EngineCall()
        call.streaming()
        tap = UsageTap(call, drop=drop)
        out = tap.feed(stream[:cut]) + tap.feed(stream[cut:]) + tap.end()
        assert out == (stream.replace(usage, b"") if drop else stream), cut
        assert (call.state, call.total, call.generated) == (State.DONE, 9, 2), cut


def test_a_client_without_usage_gets_what_vllm_sends_it() -> None:
    """vLLM asked for usage moves `system_fingerprint` from the last chunk to the usage
    chunk: the client that did not ask gets that last chunk as vLLM sends it to a request
    without `include_usage` (bytes of vLLM 0.32's own models, `model_dump_json`)."""
    head = b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
    token = head + b'"choices":[{"index":0,"delta":{"content":"x"},"logprobs":null,'
    token += b'"finish_reason":null}]}\n\n'
    last = head + b'"choices":[{"index":0,"delta":{"content":"x"},"logprobs":null,'
    last += b'"finish_reason":"length"}]'
    fingerprint = b',"system_fingerprint":"vllm-0.32.0-abcd1234"'
    usage = head + b'"choices":[],"usage":{"prompt_tokens":1,"total_tokens":3,'
    usage += b'"completion_tokens":2}' + fingerprint + b"}\n\n"
    asked = token + last + b"}\n\n" + usage + b"data: [DONE]\n\n"  # what vLLM sends asked
    unasked = token + last + fingerprint + b"}\n\n" + b"data: [DONE]\n\n"  # and not asked
    for cut in range(1, len(asked)):
        call = EngineCall()
        call.streaming()
        tap = UsageTap(call, drop=True)
        assert tap.feed(asked[:cut]) + tap.feed(asked[cut:]) + tap.end() == unasked, cut
        assert (call.state, call.total, call.generated) == (State.DONE, 3, 2)
