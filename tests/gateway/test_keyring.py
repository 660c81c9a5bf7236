"""API keys -> tenants (gateway/auth.py), including the values it remembers as valid."""

from __future__ import annotations

import pytest

from ctxcache.errors import InvalidAPIKey
from gateway import auth
from gateway.auth import KeyRing


def test_a_known_key_names_its_tenant_and_a_guess_never_does() -> None:
    ring = KeyRing({"k1": "a", "k2": "b"})
    for _ in range(2):  # the second time from what it remembers
        assert ring.tenant_for("Bearer k1") == "a"
        assert ring.tenant_for("bearer  k2 ") == "b"
    for bad in ("Bearer k3", "Bearer k1x", "Basic k1", "Bearer ", "k1", None):
        for _ in range(2):  # a guess is never remembered: refused the second time too
            with pytest.raises(InvalidAPIKey):
                ring.tenant_for(bad)


def test_it_remembers_at_most_so_many_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "_KNOWN_MAX", 2)
    ring = KeyRing({"k": "t"})
    for spaces in range(5):  # five spellings of one valid key
        assert ring.tenant_for("Bearer " + "k" + " " * spaces) == "t"
    assert len(ring._known) == 2
