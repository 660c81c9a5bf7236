"""`ctxcache bench cold-kv` end to end on the tiny model: four real sidecars, plain and fp8."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.test_commands import run_bench


@pytest.mark.slow  # a benchmark's run end to end, ~30 s: make test-slow (docs/testing.md)
@pytest.mark.timeout(300)
def test_bench_cold_kv_halves_bytes_and_compares_answers(tmp_path: Path, tiny_model: Path) -> None:
    data = run_bench(
        "cold-kv",
        tmp_path / "coldkv",
        *("--model", str(tiny_model), "--dtypes", "bfloat16", "--conversations", "1"),
        *("--context", "300", "--turn", "8", "--answer", "4", "--reps", "1", "--threads", "1"),
    )
    (result,) = data["results"]
    assert result["dtype"] == "bfloat16" and result["plain_equals_recompute"] is True
    cases = result["cases"]
    plain, fp8 = cases["plain-memory"], cases["fp8-memory"]
    # the tiny preset's rows are 2 heads x 32: 64 fp8 bytes and a 4-byte scale for 128 bytes
    assert plain["bytes"] == 300 * result["kv_bytes_per_token"]
    assert 68 / 128 < fp8["bytes"] / plain["bytes"] < 68 / 128 + 0.001
    assert cases["fp8-disk"]["bytes"] == fp8["bytes"]
    assert plain["kv_rel_err"] == 0 and plain["kl_max"] == 0 and plain["greedy_exact"] == 1
    assert 0 < fp8["kv_rel_err"] < 0.04  # e4m3's rounding, not garbage
    assert fp8["kl_mean"] >= 0 and 0 <= fp8["top1_agree"] <= 1
    assert all(c["load_s"] > 0 for k, c in cases.items() if k != "fp8-chunk")
    table = (tmp_path / "coldkv" / "cold-kv.md").read_text()
    assert "fp8, memory" in table and "plain, disk" in table
