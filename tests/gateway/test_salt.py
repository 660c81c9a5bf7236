"""Per-tenant `cache_salt` (gateway/salt.py): the bytes that go to a worker."""

from __future__ import annotations

import orjson
import pytest

from ctxcache.errors import InvalidRequest
from gateway.salt import CacheSalt

BODIES = [
    b'{"model":"m","prompt":"}"}',
    b'{ "model": "m", "messages": [{"role": "user", "content": "{}"}] } \n',
    b'{"model":"m","stream":true,"cache_salt":"mine"}',
    b"{}",
]


@pytest.mark.parametrize("raw", BODIES)
def test_salted_bytes_are_the_body_with_the_tenants_salt(raw: bytes) -> None:
    salt = CacheSalt()
    doc = orjson.loads(raw)
    want = {**doc, "cache_salt": salt.of("a", doc.get("cache_salt"))}
    out = salt.salted("a", dict(doc), raw)
    assert orjson.loads(out) == want
    assert orjson.loads(salt.salted("b", dict(doc), raw)) != want  # another tenant's


def test_no_salt_leaves_the_bytes_as_they_came() -> None:
    raw = BODIES[1]
    assert CacheSalt(enabled=False).salted("a", orjson.loads(raw), raw) is raw


def test_a_bad_client_salt_is_refused() -> None:
    with pytest.raises(InvalidRequest):
        CacheSalt().salted("a", {"model": "m", "cache_salt": 3}, b'{"model":"m","cache_salt":3}')
