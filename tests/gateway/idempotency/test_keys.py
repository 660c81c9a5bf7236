"""`gateway.idempotency`: the header's checks and what a key names (no server needed)."""

from __future__ import annotations

import pytest

from cache_manager.keys import valid_session_id
from ctxcache.errors import InvalidRequest
from gateway.idempotency import MAX_KEY_CHARS, IdempotencyKey, check_header


@pytest.mark.parametrize(
    "value",
    ["", " x", "x ", "a\x00b", "a\x01", "a\tb", "a\nb", "a\x7f", "clé", "ключ", "k" * 256],
)
def test_unusable_values_are_invalid_requests(value: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        check_header([value])
    assert err.value.param == "idempotency-key" and err.value.status == 400


def test_usable_values_and_absence() -> None:
    assert check_header([]) is None
    for value in ["a", "stainless-python-retry-0b1c", "k" * MAX_KEY_CHARS, "a b:c/d=e"]:
        assert check_header([value]) == value
    with pytest.raises(InvalidRequest):
        check_header(["a", "a"])  # two headers, even equal ones


def key(
    tenant: str = "t", value: str = "k", raw: bytes = b"{}", route: str = "/r"
) -> IdempotencyKey:
    made = IdempotencyKey.of(value, tenant, route, raw, ttl_s=60)
    assert made is not None
    return made


def test_keys_are_scoped_per_tenant_and_bind_the_request() -> None:
    a, b = key("a"), key("b")
    assert a.name != b.name and a.session_id() != b.session_id()
    assert key("a").name == a.name and key("a").session_id() == a.session_id()
    assert key(raw=b'{"x":1}').request != key().request
    assert key(route="/other").request != key().request
    assert key(value="k2").request == key().request  # the request hash is the request's only
    assert valid_session_id(a.session_id())
    # no ambiguity from concatenation: ("ab", "c") and ("a", "bc") differ
    assert key("ab", "c").name != key("a", "bc").name
    assert IdempotencyKey.of(None, "t", "/r", b"", ttl_s=60) is None
