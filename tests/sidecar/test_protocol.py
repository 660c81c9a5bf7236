"""Header layout of the lm:// protocol (checked against LMCache itself in test_interop)."""

from __future__ import annotations

import struct

import pytest

from sidecar import protocol as p


def test_header_sizes_match_lmcache() -> None:
    assert p.REQUEST.size == 186
    assert p.REPLY.size == 36


def test_request_round_trip() -> None:
    raw = p.pack_request(
        p.Command.PUT, "m@1@0@ab@bfloat16@s%x", length=99, fmt=1, dtype=3, shape=(2, 4, 256, 8)
    )
    assert len(raw) == 186
    req = p.unpack_request(raw)
    assert req == p.Request(1, 99, 1, 3, 0, (2, 4, 256, 8), "m@1@0@ab@bfloat16@s%x")
    # LMCache pads the key with spaces: the field's tail is spaces, not NULs
    assert raw[-150:].endswith(b" ")


def test_request_key_padded_with_nuls_is_accepted() -> None:
    raw = struct.pack("iiiiiiiii150s", 2, 0, 1, 2, 0, 0, 0, 0, 0, b"k@1@0@1@half")
    assert p.unpack_request(raw).key == "k@1@0@1@half"


def test_key_longer_than_field_is_rejected() -> None:
    with pytest.raises(ValueError):
        p.pack_request(p.Command.GET, "x" * 151)


def test_reply_round_trip_and_fixed_replies() -> None:
    raw = p.pack_reply(p.Code.SUCCESS, length=7, fmt=1, dtype=4, shape=(1, 2, 3, 4))
    assert p.unpack_reply(raw) == p.Reply(200, 7, 1, 4, (1, 2, 3, 4), 0)
    # what LMCache's server sends for a miss / EXIST / HEALTH: fmt 1, float16 (2), zero shape
    assert p.unpack_reply(p.REPLY_MISS) == p.Reply(400, 0, 1, 2, (0, 0, 0, 0), 0)
    assert p.unpack_reply(p.REPLY_OK) == p.Reply(200, 0, 1, 2, (0, 0, 0, 0), 0)
