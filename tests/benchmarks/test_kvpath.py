"""`ctxcache bench kvpath`: the connector's loads and stores against a plain copy, and
`--engine vllm`, a cold session turn beside a hot one on real vLLM (the tiny model)."""

from __future__ import annotations

import importlib.util
import json
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.test_commands import RUN_TIMEOUT_S, run_bench
from tests.utils import check_png, require_vllm


@pytest.mark.timeout(300)
def test_kvpath_times_both_paths_against_a_plain_copy(tmp_path: Path) -> None:
    """Both paths, and `--block-tokens 64,128`: every row once per kernel block size, named
    in a column; an MLA model's latent beside full attention (DeepSeek-V2-Lite: 27 layers
    of one 576-channel latent, vLLM's CPU MLA write); where vLLM is installed an fp8 cache
    too (`--dtype bfloat16,fp8`: vLLM's own fp8 cache write, AVX-512; full attention only),
    each row beside a plain copy of its own bytes, with its bytes per token (one run: a
    bench run costs seconds)."""
    import torch

    # (vLLM's CPU fp8 cache write needs AVX-512 or AMX)
    fp8 = importlib.util.find_spec("vllm") is not None and torch.cpu._is_avx512_supported()
    data = run_bench(
        "kvpath",
        tmp_path / "kvpath",
        *("--shapes", "small,deepseek-v2-lite", "--rounds", "1", "--tokens", "300"),
        *("--paths", "tcp,shm", "--block-tokens", "64,128"),
        *("--dtype", "bfloat16,fp8" if fp8 else "bfloat16"),
    )
    rows = data["results"]
    if fp8:
        check_fp8_rows(rows, (tmp_path / "kvpath" / "kvpath.md").read_text())
    assert data["meta"]["block_tokens"] == [64, 128]
    cases = {(p, op) for p in ("tcp", "shm") for op in ("load", "store")} | {("tcp", "get")}
    for n, latent in ((64, False), (128, False), (64, True), (128, True)):
        ran = {
            (r["path"], r["op"]) for r in rows if (r["block_tokens"], r["latent"]) == (n, latent)
        }
        assert ran == cases  # tcp also times its GETs alone
    for r in rows:
        assert r["tokens"] == 300 and r["bytes"] > 0
        assert r["vs_copy"] > 0 and r["gbps"] > 0, r
        itemsize = 1 if r["dtype"] == "fp8" else 2  # (else bf16)
        per_token = 27 * 576 * itemsize if r["latent"] else 2 * 12 * 4 * 64 * itemsize
        assert r["bytes_per_token"] == per_token, r
    layouts = {r["layout"] for r in rows if r["latent"]}
    assert layouts == {"vLLM CPU MLA latent"} or layouts == {"MLA latent (torch write)"}
    for r in rows:
        if r["path"] == "shm":  # the shm rows went through shared memory
            assert r["counters"]["load_bytes_shm"] > 0, r
    table = (tmp_path / "kvpath" / "kvpath.md").read_text()
    assert (
        "| N |" in table.replace("KV shape | N", "| N |") and "64,128-token kernel blocks" in table
    )
    assert "gpu_seconds" not in rows[0] and "On the GPU" not in table


def check_fp8_rows(rows: list[dict[str, object]], table: str) -> None:
    """fp8 rows at half of bf16's bytes per token (the small preset: 12 layers x 4 x 64)."""
    rows = [r for r in rows if not r["latent"]]  # (an MLA latent runs in bf16 only here)
    per_token = {r["dtype"]: r["bytes_per_token"] for r in rows}
    assert per_token == {"bfloat16": 2 * 2 * 12 * 4 * 64, "fp8": 2 * 12 * 4 * 64}
    fp8 = [r for r in rows if r["dtype"] == "fp8"]
    assert {(r["path"], r["op"]) for r in fp8} == {
        (p, op) for p in ("tcp", "shm") for op in ("load", "store")
    } | {("tcp", "get")}
    for r in fp8:
        assert r["bytes"] == 300 * 2 * 12 * 4 * 64 and "fp8" in str(r["layout"]), r
    assert "| B / token |" in table and "| 6144 |" in table and "| 12288 |" in table


@pytest.mark.timeout(300)
def test_kvpath_state_moves_a_recurrent_state_block_beside_a_plain_copy(tmp_path: Path) -> None:
    """`--state`: a hybrid model's state block (vLLM's strided page views) read, written,
    PUT and loaded through the connector's state side and a real sidecar, each checked and
    beside a plain copy of the same bytes."""
    data = run_bench("kvpath", tmp_path / "state", "--state", "tiny-hybrid", "--rounds", "1")
    (row,) = data["results"]
    assert row["bytes"] == 2 * (3 * 1024 * 2 + 4 * 128 * 128 * 4)  # 2 layers: conv + state
    assert set(row["ops"]) == {"read", "write", "put", "load"}
    for op in row["ops"].values():
        assert op["ms"] > 0 and op["vs_copy"] > 0
    assert "load: GET over lm:// and write" in (tmp_path / "state" / "kvpath.md").read_text()


def test_the_default_kernel_block_sizes_follow_the_device() -> None:
    """CPU: vLLM's CPU backend's 128; CUDA: the GPU default 16 beside 128."""
    import torch

    from benchmarks.kvpath.kvpath import block_sizes

    assert block_sizes(None, torch.device("cpu")) == [128]
    assert block_sizes(None, torch.device("cuda")) == [16, 128]
    assert block_sizes("16, 64", torch.device("cpu")) == [16, 64]


def test_the_gpu_table_puts_peak_memory_beside_the_ring() -> None:
    """The CUDA rows' own table (built from rows as a GPU run writes them)."""
    from benchmarks.kvpath.kvpath import cuda_markdown

    row = {"shape": "Llama-3-8B", "block_tokens": 16, "path": "shm", "op": "load"}
    row |= {"gpu_seconds": 0.02, "gpu_copy_seconds": 0.015, "gpu_vs_copy": 0.75}
    row |= {"lease_seconds": 0.001, "copies_seconds": 0.021, "release_seconds": 0.0005}
    row |= {"peak_device_bytes": 3 << 20, "ring_bytes": 64 << 20}
    table = cuda_markdown([row, {"shape": "x", "op": "load", "path": "tcp"}])
    line = next(x for x in table.splitlines() if "Llama-3-8B" in x)
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:4] == ["Llama-3-8B", "16", "shm", "load"]
    assert cells[6] == "0.750" and cells[-2:] == ["3.00", "64.00"]
    assert sum(x.startswith("|") for x in table.splitlines()) == 3  # header, rule, one row
    assert cuda_markdown([{"shape": "x", "op": "load"}]) == ""  # CPU: no GPU table


@pytest.mark.slow  # minutes on 2 CPUs: `make test-slow` (CI runs it)
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_kvpath_on_vllm_cold_turns_load_through_shm_and_answer_like_the_full_history(
    tmp_path: Path, tiny_model: Path
) -> None:
    require_vllm()
    out = tmp_path / "kvpath-vllm"
    argv = ["bench", "kvpath", "--engine", "vllm", "--out", str(out)]
    argv += ["--preset", "tiny", "--model-dir", str(tiny_model), "--dtypes", "float32"]
    argv += ["--paths", "shm", "--rounds", "2", "--context-tokens", "600"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ctxcache.cli", *argv], stderr=subprocess.PIPE, text=True
    )
    try:
        _, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the bench stops every server it started
        _, stderr = proc.communicate(timeout=60)
        pytest.fail(f"still running after {RUN_TIMEOUT_S}s: {stderr[-3000:]}")
    assert proc.returncode == 0, stderr[-3000:]
    assert "%|" in stderr, "no tqdm progress bar on stderr"

    data = json.loads((out / "kvpath-vllm.json").read_text())
    assert set(data) == {"meta", "results"}
    meta = data["meta"]
    assert meta["command"] == shlex.join(["ctxcache", *argv])
    assert (meta["engine"], meta["dtypes"], meta["paths"], meta["rounds"]) == (
        "vllm",
        ["float32"],
        ["shm"],
        2,
    )
    [row] = data["results"]
    assert (row["dtype"], row["path"], row["rounds"]) == ("float32", "shm", 2)
    assert 500 <= row["context_tokens"] <= 600
    assert row["hot_ttft_p50_ms"] > 0 and row["cold_ttft_p50_ms"] > 0
    assert len(row["cold_vs_hot_rounds"]) == 2 and row["cold_vs_hot"] > 0
    # every answer, hot and cold, is the full history's
    assert row["answers"] == 4 and row["answers_matched"] == row["answers_matched_cached"] == 4
    assert row["cold_equals_hot"] == 2
    # every cold turn loaded its history, through shared memory only, and nothing failed
    assert row["cold_cached_ok"] and row["cold_loaded_tokens_min"] >= row["context_tokens"] - 128
    counters = row["counters"]
    assert counters["load_bytes_shm"] > 0 and counters["load_bytes_tcp"] == 0
    assert counters["load_failures"] == 0 and counters["load_races"] == 0
    assert row["hot_loaded_tokens"] == 0  # a hot turn is vLLM's own prefix cache
    assert row["others_cpu_percent"] >= 0
    kinds = [t["kind"] for t in row["turns"]]
    assert {k: kinds.count(k) for k in set(kinds)} == dict.fromkeys(
        ("hot", "cold", "reference", "cached-reference"), 3
    )

    table = (out / "kvpath-vllm.md").read_text()
    assert table.startswith(f"`{meta['command']}` — {meta['date']}")
    assert "| float32 | shm |" in table
    check_png(out / "kvpath-vllm.png")
    assert (out / "servers-float32-shm.log").stat().st_size > 0
