"""API keys -> tenants (gateway/auth.py), including the keys it remembers as valid."""

from __future__ import annotations

import hashlib

import pytest

from ctxcache.errors import InvalidAPIKey
from gateway import auth
from gateway.auth import KeyRing
from gateway.limits import KeyPolicy, key_id


def test_a_known_key_names_its_tenant_and_a_guess_never_does() -> None:
    ring = KeyRing({"k1": "a", "k2": "b"})
    for _ in range(2):  # the second time from what it remembers
        assert ring.tenant_for("Bearer k1") == "a"
        assert ring.tenant_for("bearer  k2 ") == "b"
    for bad in ("Bearer k3", "Bearer k1x", "Basic k1", "Bearer ", "k1", None):
        for _ in range(2):  # a guess is never remembered: refused the second time too
            with pytest.raises(InvalidAPIKey):
                ring.tenant_for(bad)


def test_it_remembers_at_most_so_many_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "_KNOWN_MAX", 2)
    ring = KeyRing({f"k{i}": f"t{i}" for i in range(5)})
    for i in range(5):
        assert ring.tenant_for(f"Bearer k{i}") == f"t{i}"
    assert len(ring._known) == 2
    assert [ring.tenant_for(f"Bearer k{i}") for i in range(5)] == [f"t{i}" for i in range(5)]


def test_spellings_of_one_key_take_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant cannot fill the memory with case and space variants of its own key, so
    that other keys are never remembered (issue 39, item 10)."""
    monkeypatch.setattr(auth, "_KNOWN_MAX", 2)
    ring = KeyRing({"k": "t", "other": "u"})
    spellings = ["Bearer k", "bearer k", "BEARER k", "BeArEr k", "Bearer  k", "Bearer k  "]
    spellings += ["bearer \tk\t", "Bearer k\t"]
    for value in spellings:
        assert ring.tenant_for(value) == "t"
    assert len(ring._known) == 1
    assert ring.tenant_for("Bearer other") == "u"
    assert len(ring._known) == 2  # the other key is remembered too


def test_a_key_given_as_its_digest_opens_with_the_key_not_the_digest() -> None:
    digest = "sha256:" + hashlib.sha256(b"sk-real").hexdigest()
    ring = KeyRing({digest: KeyPolicy(tenant="t", rpm=5)})
    key = ring.key_for("Bearer sk-real")
    assert (key.tenant, key.rpm) == ("t", 5)
    assert key.id == key_id("sk-real") == key_id(digest)  # one budget, however it is given
    for bad in (f"Bearer {digest}", f"Bearer {digest.removeprefix('sha256:')}"):
        with pytest.raises(InvalidAPIKey):  # the digest is no password
            ring.key_for(bad)
    upper = KeyRing({digest.upper().replace("SHA256:", "sha256:"): "t"})
    assert upper.tenant_for("Bearer sk-real") == "t"  # hex in either case


def test_replace_swaps_every_key_and_forgets_the_remembered_ones() -> None:
    ring = KeyRing({"a": "t"})
    assert ring.tenant_for("Bearer a") == "t" and not ring.limited
    ring.replace({"b": KeyPolicy(tenant="u", tpm=9)})
    with pytest.raises(InvalidAPIKey):  # remembered before, refused now
        ring.tenant_for("Bearer a")
    assert ring.tenant_for("Bearer b") == "u" and ring.limited and ring.tenants == ["u"]
