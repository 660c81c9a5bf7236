from __future__ import annotations

import subprocess
import sys

import pytest

from ctxcache.lmcache_keys import parse_key
from worker.kv.hashing import KeyMaker, chain_hash, chain_hashes_each, chunk_hashes


def test_chunk_hashes_are_prefix_chained() -> None:
    a = list(range(100))
    b = a[:64] + [7] * 36
    ha, hb = chunk_hashes(a, 16), chunk_hashes(b, 16)
    assert len(ha) == 6 and ha[:4] == hb[:4] and ha[4] != hb[4]
    # the same chunk after a different prefix hashes differently
    assert chunk_hashes([9] * 16 + a[16:32], 16)[1] != ha[1]
    assert chunk_hashes(a, 16, limit=47) == ha[:2]


def test_hashes_are_the_same_in_another_process() -> None:
    code = "from worker.kv.hashing import chunk_hashes; print(chunk_hashes(list(range(64)), 32))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert outs == {f"{chunk_hashes(list(range(64)), 32)}\n"}


def test_keys_carry_tags_in_lmcache_form() -> None:
    keys = KeyMaker("tiny", "float", 3)
    h = chain_hash(0, [1, 2, 3])
    a = keys.key(h, (("s", "abc"),))
    b = keys.key(h, (("s", "xyz"),))
    assert a != b
    parsed = parse_key(a)
    assert (parsed.model, parsed.worker_id, parsed.chunk_hash, parsed.dtype, parsed.session) == (
        "tiny",
        3,
        h,
        "float",
        "abc",
    )
    with pytest.raises(ValueError):
        keys.key(h, (("s", "x" * 200),))


def test_the_hashes_of_every_prefix_in_one_pass_are_each_prefixs_chain_hash() -> None:
    ids = [7, 1 << 20, 0, 31999, 5] * 20
    each = chain_hashes_each(12345, ids)
    assert each == [chain_hash(12345, ids[:k]) for k in range(1, len(ids) + 1)]
    assert chain_hashes_each(0, []) == []
