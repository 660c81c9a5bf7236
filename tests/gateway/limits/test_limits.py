"""The rate-limit pieces without a network: the `KEY=TENANT[:rpm=N][,tpm=N]` grammar and its
settings form (hostile values refused with a reason), the key ring's limits, the header
math, the token estimate; and `ctxcache gateway` / `serve` stopping at start-up on a bad
`--api-key` (real processes, before anything is started)."""

from __future__ import annotations

import hashlib
import re

import pytest
from pydantic import ValidationError

from cache_manager.protocol import RateWindow
from gateway.auth import KeyRing
from gateway.limits import KeyPolicy, key_id, parse_key_spec, parse_key_specs
from gateway.ratelimit import duration, estimate_tokens, rate_headers, refusal, too_large
from gateway.settings import GatewaySettings
from tests.utils import run_clis


@pytest.mark.parametrize(
    ("spec", "key", "tenant", "rpm", "tpm"),
    [
        ("sk-1=acme", "sk-1", "acme", None, None),
        ("sk-1=acme:rpm=30", "sk-1", "acme", 30, None),
        ("sk-1=acme:tpm=1000", "sk-1", "acme", None, 1000),
        ("sk-1=acme:rpm=30,tpm=1000", "sk-1", "acme", 30, 1000),
        ("sk-1=acme:tpm=5,rpm=1", "sk-1", "acme", 1, 5),
        ("sk-1=acme:rpm=1000000000000", "sk-1", "acme", 10**12, None),
        # the key ends at the last '=' before the first ':' (a tenant holds neither)
        ("k=x=y", "k=x", "y", None, None),
        ("sk-abc==acme:rpm=5", "sk-abc=", "acme", 5, None),
        ("c2stc2VjcmV0==acme", "c2stc2VjcmV0=", "acme", None, None),  # base64 padding kept
        ("a+b/c==t:tpm=9,rpm=8", "a+b/c=", "t", 8, 9),
        ("sk-1=Acme.eu-west_2", "sk-1", "Acme.eu-west_2", None, None),
        ("sk-1=0", "sk-1", "0", None, None),
        ("sk-1=acme: rpm = 5 ", "sk-1", "acme", 5, None),  # spaces around an option
    ],
)
def test_good_specs(spec: str, key: str, tenant: str, rpm: int | None, tpm: int | None) -> None:
    got_key, policy = parse_key_spec(spec)
    assert (got_key, policy.tenant, policy.rpm, policy.tpm) == (key, tenant, rpm, tpm)
    assert parse_key_spec(f"{got_key}={policy.spec()}") == (got_key, policy)  # round trip


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("sk-1", "no '=' found"),
        ("=acme", "the key is empty"),
        (" sk=acme", "has a space"),
        ("s k=acme", "has a space"),
        ("sk-\u00e9=acme", "outside ASCII"),
        ("sk\x7f=acme", "control character"),
        ("sk:1=acme", "no '=' before the first ':'"),  # a key with ':' goes in the file
        ("sk-1=", "the tenant is empty"),
        ("c2stc2VjcmV0==", "the tenant is empty"),  # a base64 key without its tenant
        ("sk-1=acme=", "the tenant is empty"),
        ("sk-1=acme:", "nothing after ':'"),
        ("sk-1=acme:rpm=0", "from 1 to"),
        ("sk-1=acme:rpm=-5", "from 1 to"),
        ("sk-1=acme:rpm=+5", "from 1 to"),
        ("sk-1=acme:rpm=1.5", "from 1 to"),
        ("sk-1=acme:rpm=1e3", "from 1 to"),
        ("sk-1=acme:rpm=1_000", "from 1 to"),
        ("sk-1=acme:rpm=", "from 1 to"),
        ("sk-1=acme:rpm", "from 1 to"),
        ("sk-1=acme:rpm=thirty", "from 1 to"),
        ("sk-1=acme:rpm=1000000000001", "from 1 to"),
        ("sk-1=acme:rpm=99999999999999999999999999", "from 1 to"),
        ("sk-1=acme:rpm=" + "9" * 5000, "from 1 to"),  # past int()'s digit limit
        ("sk-1=acme:tpm=5:rpm=6", "from 1 to"),
        ("sk-1=acme:rpd=5", "unknown option"),
        ("sk-1=acme:RPM=5", "unknown option"),
        ("sk-1=acme:rpm=5,", "unknown option"),
        ("sk-1=acme:rpm=5,rpm=6", "rpm given twice"),
        ("sk-1=acme:rpm=5;tpm=6", "from 1 to"),
        ("sk-1=ac\x00me", "a tenant is 1 to 256"),
        ("sk-1=ac me", "a tenant is 1 to 256"),
        ("sk-1=a{b}", "a tenant is 1 to 256"),
        ("sk-1=.acme", "a tenant is 1 to 256"),
        ("sk-1=-acme:rpm=5", "a tenant is 1 to 256"),
        ("c2stc2VjcmV0=/+9Qz", "a tenant is 1 to 256"),  # the tail of a key, not a tenant
        ("ab=cd:ef=gh=acme", "unknown option"),  # a key with ':' read as options
        ("sk-1=" + "t" * 257, "at most 256"),
    ],
)
def test_hostile_specs_are_refused_with_a_reason(spec: str, reason: str) -> None:
    with pytest.raises(ValueError, match=None) as exc:
        parse_key_spec(spec)
    message = str(exc.value)
    assert reason in message, message
    # nothing of the input is repeated: any part of it may be a piece of a key
    for part in re.split(r"[=:,]", spec):
        assert len(part) < 2 or part in {"rpm", "tpm"} or part not in message, message


def test_a_key_given_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="given twice"):
        parse_key_specs(["k=a:rpm=1", "k=b"])


def test_settings_take_specs_and_objects_and_refuse_the_rest() -> None:
    keys = GatewaySettings(
        api_keys={"a": "t1:rpm=3", "b": {"tenant": "t2", "tpm": 9}, "c": "t3"}
    ).api_keys
    assert keys == {
        "a": KeyPolicy(tenant="t1", rpm=3),
        "b": KeyPolicy(tenant="t2", tpm=9),
        "c": KeyPolicy(tenant="t3"),
    }
    for bad in (
        {"a": "t:rpm=0"},
        {"a": {"tenant": "t", "rpm": 0}},
        {"a": {"tenant": "t", "rpm": -1}},
        {"a": {"tenant": "t", "tpm": 10**12 + 1}},
        {"a": {"tenant": "t", "tpm": 10**100}},
        {"a": {"tenant": "t", "rpm": 1.5}},
        {"a": {"tenant": "t", "rpm": "30"}},
        {"a": {"tenant": "t", "rpm": True}},
        {"a": {"tenant": "t", "burst": 3}},
        {"a": {"rpm": 3}},
        {"a": 5},
        {"": "t"},
        {"a b": "t"},
        {"a\u00e9": "t"},
        {"sha256:abc": "t"},
        {"a": "t{"},
        {"a": {"tenant": "t u"}},
        {"a": "t", "sha256:" + hashlib.sha256(b"a").hexdigest(): "u"},  # a key and its digest
    ):
        with pytest.raises(ValidationError):
            GatewaySettings(api_keys=bad)
    for name, value in (
        ("rate_limit_window_s", 0),
        ("rate_limit_window_s", -1),
        ("rate_limit_window_s", 7200),
        ("rate_limit_on_store_error", "maybe"),
        ("rate_limit_default_max_tokens", -1),
        ("metrics_token", "short"),
    ):
        with pytest.raises(ValidationError):
            GatewaySettings(**{name: value})


def test_the_ring_knows_each_keys_limits() -> None:
    ring = KeyRing({"a": KeyPolicy(tenant="t", rpm=3), "b": "t", "c": KeyPolicy(tenant="u")})
    assert ring.limited
    a, b = ring.key_for("Bearer a"), ring.key_for("Bearer b")
    assert (a.tenant, a.rpm, a.tpm, a.limited) == ("t", 3, None, True)
    assert (b.tenant, b.limited) == ("t", False)
    assert a.id == key_id("a") != b.id and a.id != "a"
    assert not KeyRing({"b": "t"}).limited


def test_reset_durations_read_as_openais() -> None:
    assert [duration(ms) for ms in (0, 20, 999, 1000, 1500, 59_999, 60_000, 360_500)] == [
        "0ms",
        "20ms",
        "999ms",
        "1s",
        "1.5s",
        "59.999s",
        "1m0s",
        "6m0.5s",
    ]


def window(requests: int, tokens: int, reset_ms: int = 1234) -> RateWindow:
    return RateWindow(
        allowed=True, requests=requests, tokens=tokens, reset_ms=reset_ms, window_end_ms=1
    )


def test_headers_and_the_refusal() -> None:
    key = KeyRing({"k": KeyPolicy(tenant="t", rpm=30, tpm=1000)}).key_for("Bearer k")
    headers = dict(rate_headers(key, window(12, 1200)))
    assert headers == {
        b"x-ratelimit-limit-requests": b"30",
        b"x-ratelimit-remaining-requests": b"18",
        b"x-ratelimit-reset-requests": b"1.234s",
        b"x-ratelimit-limit-tokens": b"1000",
        b"x-ratelimit-remaining-tokens": b"0",  # an overdraw shows as none left
        b"x-ratelimit-reset-tokens": b"1.234s",
    }
    err = refusal(key, window(30, 10), reserved=5)
    assert err.status == 429 and err.code == err.type == "rate_limit_exceeded"
    assert err.headers["retry-after-ms"] == "1234" and err.headers["retry-after"] == "2"
    assert "requests per minute (rpm): limit 30, used 30" in err.message
    err = refusal(key, window(3, 990), reserved=50)
    assert "tokens per minute (tpm): limit 1000, used 990, requested 50" in err.message
    assert refusal(key, window(30, 0, reset_ms=0), 1).headers["retry-after-ms"] == "1"
    big = too_large(key, 5000)
    assert big.headers == {"x-should-retry": "false"} and "requested 5000" in big.message


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ({"prompt": "hello", "max_tokens": 10}, 2 + 10),  # 5 UTF-8 bytes -> 2
        ({"prompt": "é" * 4, "max_tokens": 0}, 2),  # 8 bytes
        ({"prompt": [1, 2, 3], "max_tokens": 5}, 3 + 5),  # token ids count one each
        ({"prompt": "abcd"}, 1 + 256),  # no max: the default
        ({"prompt": "abcd", "max_completion_tokens": 7}, 1 + 7),
        ({"input": "abcd", "instructions": "abcdefgh", "max_output_tokens": 3}, 1 + 2 + 3),
        ({"prompt": "abcd", "max_tokens": 4, "n": 3}, 1 + 12),
        ({"prompt": "abcd", "max_tokens": 4, "n": "3"}, 1 + 12),  # (as the engine reads it)
        ({"prompt": "abcd", "max_tokens": -4}, 1 + 256),
        ({"prompt": "abcd", "max_tokens": True}, 1 + 256),
        ({"prompt": "abcd", "max_tokens": 2.5}, 1 + 3),  # (the app refuses it; reserved whole)
        ({"prompt": "abcd", "max_tokens": 10**30}, 1 + 10**15),  # past any budget
        ({"prompt": "abcd", "max_tokens": 1e300}, 1 + 10**15),
        ([1, 2], 0),
        ("text", 0),
    ],
)
def test_the_token_estimate(doc: object, expected: int) -> None:
    assert estimate_tokens(doc, default_max_tokens=256) == expected


def test_messages_are_estimated_from_their_json() -> None:
    messages = [{"role": "user", "content": "x" * 100}]
    size = len(b'[{"role":"user","content":"' + b"x" * 100 + b'"}]')
    got = estimate_tokens({"messages": messages, "max_tokens": 0}, default_max_tokens=0)
    assert got == -(-size // 4)


@pytest.mark.parametrize("command", ["gateway", "serve"])
def test_a_bad_api_key_stops_the_command_at_once(command: str) -> None:
    cases = (
        ("sk-secret=acme:rpm=0", "from 1 to"),
        ("sk-secret=acme:burst=5", "unknown option"),
        ("sk-secret", "no '=' found"),
    )
    *refused, twice = run_clis(
        [((command, "--api-key", spec, "--port", "1"), None) for spec, _ in cases]
        + [((command, "--api-key", "sk-secret=a", "--api-key", "sk-secret=b"), None)]
    )
    for done, (_, reason) in zip(refused, cases, strict=True):
        assert done.returncode == 2, done.stderr
        assert "--api-key" in done.stderr and reason in done.stderr
    assert twice.returncode != 0 and "given twice" in twice.stderr
    assert "sk-secret" not in twice.stderr


def test_bad_gateway_settings_in_the_environment_stop_it_without_the_key() -> None:
    envs: list[tuple[dict[str, str], str]] = []
    for value, reason in (
        ('{"sk-secret": "acme:rpm=-1"}', "from 1 to"),
        ('{"sk-secret": {"tenant": "acme", "rpm": 0}}', "from 1 to"),
        ('{"sk-secret": {"tenant": "acme", "rpm": 1e400}}', "valid integer"),
        ('{"sk-secret": {"tenant": "acme", "rpm": %s}}' % ("9" * 5000), "not valid JSON"),
        ('{"sk-secret": {"tenant": "acme", "burst": 1}}', "Extra inputs"),
        ('{"sk-secret": {"tenant": "acme", "tenant": "beta"}}', "given twice"),
        ('{"sk-secret": "acme", "sk-secret": "beta"}', "a key is given twice"),
        ('{"sk-secret=": "acme", "sk-secret": "beta", "sk-secret=": "gamma"}', "entries 1 and 3"),
        ('{"sk-secret": "ac me"}', "a tenant is"),
        ('["sk-secret"]', "expected a JSON object"),
        ('{"sk-secret": ', "not valid JSON"),
    ):
        envs.append(({"CTX_GATEWAY_API_KEYS": value}, reason))
    envs.append(
        ({"CTX_GATEWAY_RATE_LIMIT_ON_STORE_ERROR": "sometimes"}, "rate_limit_on_store_error")
    )
    for done, (_, reason) in zip(run_clis([(("gateway",), e) for e, _ in envs]), envs, strict=True):
        assert done.returncode == 1 and reason in done.stderr, done.stderr
        assert "sk-secret" not in done.stderr


def test_a_replayed_answer_is_charged_no_tokens() -> None:
    """An Idempotency-Key replay ran nothing: its usage (the first attempt's) is not charged
    again; the same answer not replayed is."""
    from gateway.ratelimit import _Usage

    body = b'{"usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}'
    for replayed, charged in ((False, 7), (True, 0)):
        usage = _Usage()
        headers = [(b"content-type", b"application/json")]
        if replayed:
            headers.append((b"idempotent-replayed", b"true"))
        usage.start({"type": "http.response.start", "status": 200, "headers": headers})
        usage.body(body)
        usage.end()
        assert usage.total == charged
