"""A wrong API key costs what a right one costs, however many keys there are (issue 56,
item 3): the key's digest is looked up, not compared with every key's.

The hostile sequence: a gateway with 100,000 keys, a client that sprays wrong keys. Each
used to be compared with all 100,000 digests (10-30 ms of the event loop a guess, every
tenant's requests stalled meanwhile); counted here without a clock, as the digest
comparisons one lookup performs.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable

import pytest

from ctxcache.errors import InvalidAPIKey
from gateway.auth import KeyRing

KEYS = 100_000


@pytest.fixture(scope="module")
def big_ring() -> KeyRing:
    keys: dict[str, str] = {f"sk-{i:06d}": f"t{i % 100}" for i in range(KEYS - 1)}
    keys["sha256:" + hashlib.sha256(b"sk-digest-only").hexdigest()] = "digest"
    return KeyRing(keys)


def counting(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """Count `hmac.compare_digest` calls from now on (how the ring checks a digest)."""
    calls = [0]
    real = hmac.compare_digest

    def compare(a: bytes, b: bytes) -> bool:
        calls[0] += 1
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", compare)
    return lambda: calls[0]


@pytest.mark.parametrize(
    "guess", ["sk-999999", "sk-00000", "sk-0000001", "x" * 4096, "sha256:" + "0" * 64]
)
def test_a_wrong_key_among_100000_is_refused_after_one_digest_check(
    big_ring: KeyRing, monkeypatch: pytest.MonkeyPatch, guess: str
) -> None:
    calls = counting(monkeypatch)
    for _ in range(3):  # a guess is never remembered: the same work each time
        with pytest.raises(InvalidAPIKey):
            big_ring.key_for(f"Bearer {guess}")
    assert calls() <= 3


def test_a_right_key_among_100000_takes_the_same_path_as_a_wrong_one(
    big_ring: KeyRing, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hit and a miss: one lookup by digest, then one digest check each."""
    calls = counting(monkeypatch)
    assert big_ring.key_for("Bearer sk-054321").tenant == "t21"
    assert calls() == 1
    with pytest.raises(InvalidAPIKey):
        big_ring.key_for("Bearer sk-054321x")
    assert calls() == 2
    assert big_ring.key_for("Bearer sk-digest-only").tenant == "digest"  # configured as digest
    assert calls() == 3


def test_a_replaced_ring_refuses_the_keys_it_dropped_and_finds_the_new_ones() -> None:
    ring = KeyRing({"sk-a": "a", "sk-b": "b"})
    assert ring.tenant_for("Bearer sk-a") == "a"
    ring.replace({"sk-b": "b2", "sk-c": "c"})
    with pytest.raises(InvalidAPIKey):
        ring.tenant_for("Bearer sk-a")
    assert ring.tenant_for("Bearer sk-b") == "b2"
    assert ring.tenant_for("Bearer sk-c") == "c"
    assert ring.tenants == ["b2", "c"]
