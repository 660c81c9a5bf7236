"""Every `ctxcache bench NAME` end to end on a tiny workload, as a user runs it.

Each test runs the real command in a subprocess (real redis-server, sidecar, workers and
gateway, all started by the benchmark itself on free ports) with the smallest settings that
still exercise every case, then checks the three files every benchmark writes into `--out`
(see benchmarks/lib/util.py): `NAME.json` with `meta` (benchmark, date, the exact command,
the machine) and `results`, `NAME.md` (that header line and the table) and a valid `NAME.png`.
Speed is not asserted here (that is what the benchmarks are for): only that the numbers are
there, sane, and that the runs did what they say (no errors, the cached tokens were reused).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.utils import check_png

RUN_TIMEOUT_S = 280  # the machine running CI may be small and shared: generous, never hit


def run_bench(name: str, out: Path, *args: str, png: Path | None = None) -> dict[str, Any]:
    """`ctxcache bench NAME --out OUT ARGS`; its outputs checked; the parsed JSON back."""
    argv = ["bench", name, "--out", str(out), *args]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ctxcache.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # lets the bench stop the servers it started
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        pytest.fail(f"{name} bench still running after {RUN_TIMEOUT_S}s: {stderr[-3000:]}")
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    assert "%|" in stderr, "no tqdm progress bar on stderr"

    data = json.loads((out / f"{name}.json").read_text())
    assert set(data) == {"meta", "results"}
    meta = data["meta"]
    assert meta["benchmark"] == name
    assert meta["command"] == shlex.join(["ctxcache", *argv])
    started = datetime.strptime(meta["date"], "%Y-%m-%d %H:%M UTC").replace(tzinfo=UTC)
    assert abs((datetime.now(UTC) - started).total_seconds()) < 3600
    machine = meta["machine"]
    assert machine["cpus"] >= 1 and machine["python"] and machine["platform"]
    assert isinstance(data["results"], list) and data["results"]

    table = (out / f"{name}.md").read_text()
    first = table.splitlines()[0]
    assert first.startswith(f"`{meta['command']}` — {meta['date']}; {machine['cpus']} CPUs")
    assert re.search(r"^\|(---|-*:)", table, re.MULTILINE), table  # a Markdown table

    check_png(png or out / f"{name}.png")
    return data


def check_latencies(row: dict[str, Any]) -> None:
    assert math.isfinite(row["p50_ms"]) and 0 < row["p50_ms"] <= row["p99_ms"], row


@pytest.mark.timeout(300)
def test_bench_manager(tmp_path: Path) -> None:
    data = run_bench(
        "manager",
        tmp_path / "manager",
        *("--ops", "14", "--rounds", "1", "--concurrency", "1", "2"),
        *("--history", "40", "--new-tokens", "8"),
    )
    rows = data["results"]
    assert data["meta"]["concurrency"] == [1, 2] and data["meta"]["history_tokens"] == 40
    operations = {r["name"] for r in rows}
    assert len(operations) == 7 and {"session turn, in-process client"} <= operations
    assert sorted((r["name"], r["concurrency"]) for r in rows) == sorted(
        (name, c) for name in operations for c in (1, 2)
    )
    for r in rows:
        assert r["ops"] == 14 and r["ops_per_s"] > 0
        check_latencies(r)
    table = (tmp_path / "manager" / "manager.md").read_text()
    assert "| redis-py GET (1 round trip) | 1 |" in table and "| 100% |" in table


@pytest.mark.slow  # a benchmark's run end to end, 10-20 s: make test-slow (docs/testing.md)
@pytest.mark.timeout(300)
def test_bench_gateway_fake_backend_and_tiny_worker(tmp_path: Path, tiny_model: Path) -> None:
    """Our own load generator throughout (the fallback where wrk is not installed)."""
    plot = tmp_path / "img" / "gateway.png"
    data = run_bench(
        "gateway",
        tmp_path / "gateway",
        *("--requests", "20", "--model-requests", "4", "--rounds", "1", "--generator", "python"),
        *("--concurrency", "1", "2", "--stream-concurrency", "3", "--stream-tokens", "5"),
        *("--model", str(tiny_model), "--plot", str(plot)),
        png=plot,
    )
    assert not (tmp_path / "gateway" / "gateway.png").exists()
    assert data["meta"]["generator"].startswith("ours")
    rows = data["results"]
    assert all(r["generator"] == "ours" for r in rows)
    check_gateway_rows(rows, models=("fake", "tiny"), concurrency=(1, 2), stream=3)
    table = (tmp_path / "gateway" / "gateway.md").read_text()
    assert "| fake: streaming chat, gateway | 3 | ours |" in table


@pytest.mark.slow  # a benchmark's run end to end, 10-20 s: make test-slow (docs/testing.md)
@pytest.mark.timeout(300)
def test_bench_gateway_ab_two_checkouts_side_by_side(tmp_path: Path) -> None:
    """This checkout against itself: two gateways, one fake worker and one sidecar,
    interleaved rounds of streams (TTFT) and session turns."""
    root = Path(__file__).resolve().parents[2]
    data = run_bench(
        "gateway-ab",
        tmp_path / "ab",
        *("--a", str(root), "--b", str(root), "--rounds", "2", "--requests", "30"),
        *("--turn-requests", "25"),
        png=tmp_path / "ab" / "gateway-ab.png",
    )
    assert data["meta"]["trees"] == {"A": str(root), "B": str(root)}
    rows = data["results"]  # a row a round and case: each side's p50, µs
    assert [(r["round"], r["case"]) for r in rows] == [
        (n, case) for n in (0, 1) for case in ("ttft", "turn", "chat-turn")
    ]
    for row in rows:
        sides = {"A", "B", "direct"} if row["case"] == "ttft" else {"A", "B"}
        cpu = {"A_cpu", "B_cpu"}  # each gateway's CPU µs per request, from /proc
        assert set(row) - {"round", "case"} == sides | cpu and all(row[s] > 0 for s in sides)
        assert all(row[c] >= 0 for c in cpu)
    median = data["meta"]["median"]
    assert set(median) == {"ttft", "turn", "chat-turn"}
    assert all(0 < m["b_over_a"] < 100 for m in median.values())
    # (/proc counts CPU time in 10 ms ticks: a case this short may read 0)
    assert all(m["A_cpu_us"] >= 0 and m["B_cpu_us"] >= 0 for m in median.values())
    assert 0 < median["ttft"]["A_over_direct"] < 100
    table = (tmp_path / "ab" / "gateway-ab.md").read_text()
    assert "| chat-turn | median |" in table


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("wrk") is None, reason="wrk is not installed")
def test_bench_gateway_with_wrk(tmp_path: Path) -> None:
    data = run_bench(
        "gateway",
        tmp_path / "gateway",
        *("--no-model", "--generator", "wrk", "--duration", "1", "--rounds", "1"),
        *("--requests", "20", "--concurrency", "1", "2", "--stream-concurrency", "2"),
    )
    assert data["meta"]["generator"].startswith("wrk")
    rows = data["results"]
    check_gateway_rows(rows, models=("fake",), concurrency=(1, 2), stream=2)
    by_case = {(r["case"], r["concurrency"]): r["generator"] for r in rows}
    assert by_case[("fake: gateway, no session", 2)] == "wrk"
    assert by_case[("fake: streaming chat, gateway", 2)] == "wrk"
    assert by_case[("fake: gateway, session turn", 2)] == "ours"  # a session per connection
    assert by_case[("fake: streaming chat TTFT, gateway", 1)] == "ours"


@pytest.mark.slow  # a benchmark's run end to end, 10-20 s: make test-slow (docs/testing.md)
@pytest.mark.timeout(300)
def test_bench_gateway_tracing_on_beside_off_and_the_floor(tmp_path: Path) -> None:
    """Also: the gateway started from a checkout named by --gateway-tree (this one), and
    the TTFT case at concurrency 1 pinned where there are two CPUs."""
    root = Path(__file__).resolve().parents[2]
    data = run_bench(
        "gateway",
        tmp_path / "gateway",
        *("--no-model", "--tracing", "--floor", "--generator", "python", "--rounds", "1"),
        *("--requests", "20", "--concurrency", "2", "--stream-concurrency", "2"),
        *("--gateway-tree", str(root)),
    )
    assert data["meta"]["tracing"]
    assert data["meta"]["gateway_tree"] == str(root)
    assert bool(data["meta"]["pinned"]) == (len(os.sched_getaffinity(0)) >= 2)
    rows = data["results"]
    (bare,) = [r for r in rows if r["case"] == "fake: streaming chat TTFT, bare ASGI relay"]
    assert bare["errors"] == 0 and bare["ttft_ms_vs_direct"] > 0, bare  # --floor
    rows.remove(bare)
    traced = [r for r in rows if "traced" in r["case"]]
    assert {r["case"] for r in traced} == {
        "fake: traced gateway, no session",
        "fake: traced gateway, session turn",
    }
    check_gateway_rows(
        [r for r in rows if r not in traced], models=("fake",), concurrency=(2,), stream=2
    )
    for r in traced:  # measured in the same round, against the same direct case
        assert r["errors"] == 0 and r["requests_per_s_vs_direct"] > 0, r


def check_gateway_rows(
    rows: list[dict[str, Any]],
    *,
    models: tuple[str, ...],
    concurrency: tuple[int, ...],
    stream: int,
) -> None:
    kinds = (
        "direct to the worker",
        "gateway, no session",
        "gateway, session turn",
        "gateway, chat session turn",
    )
    expected = {(f"{m}: {k}", c) for m in models for k in kinds for c in concurrency}
    expected |= {
        ("fake: streaming chat, direct", stream),
        ("fake: streaming chat, gateway", stream),
        ("fake: streaming chat, gateway, passed through", stream),
    }
    expected |= {
        ("fake: streaming chat TTFT, direct", 1),
        ("fake: streaming chat TTFT, gateway", 1),
        ("fake: streaming chat TTFT, gateway, passed through", 1),
    }
    assert {(r["case"], r["concurrency"]) for r in rows} == expected
    for r in rows:
        assert r["errors"] == 0, r  # every request, session turns included, answered 200
        assert r["requests_per_s"] > 0
        check_latencies(r)
        if "direct" in r["case"]:
            assert r["p50_overhead_ms"] == 0 and r["requests_per_s_vs_direct"] is None
        else:  # against the direct case of the same round
            assert r["requests_per_s_vs_direct"] > 0 and r["p99_ms_vs_direct"] > 0
        if "TTFT" in r["case"]:  # the first chunk comes before the whole answer
            assert 0 < r["ttft_ms"] <= r["p99_ms"]
        else:
            assert r["ttft_ms"] is None


@pytest.mark.slow  # a benchmark's run end to end, 10-20 s: make test-slow (docs/testing.md)
@pytest.mark.timeout(300)
def test_bench_worker_reuses_cached_history(tmp_path: Path, tiny_model: Path) -> None:
    contexts = (40, 300)
    data = run_bench(
        "worker",
        tmp_path / "worker",
        *("--model", str(tiny_model), "--contexts", *map(str, contexts)),
        *("--reps", "1", "--new-tokens", "8", "--threads", "1"),
    )
    assert data["meta"]["machine"]["torch"].startswith("2.")
    assert data["meta"]["machine"]["torch_threads"] == 1
    rows = data["results"]
    assert [r["context_tokens"] for r in rows] == list(contexts)
    for r, context in zip(rows, contexts, strict=True):
        assert all(r[f"{case}_s"] > 0 for case in ("full", "sidecar", "l1", "floor")), r
        # the history's whole 16-token blocks are reused, from the sidecar (cold L1: one
        # 256-token chunk + tail blocks at 300) and from the L1; nothing when cold
        assert r["sidecar_cached_tokens"] == r["l1_cached_tokens"] == context // 16 * 16
        assert r["full_cached_tokens"] == 0
    table = (tmp_path / "worker" / "worker.md").read_text()
    assert "| 300 |" in table and "288 / 288 |" in table


@pytest.mark.timeout(300)
def test_bench_sidecar(tmp_path: Path) -> None:
    out = tmp_path / "sidecar"
    data = run_bench(
        "sidecar",
        out,
        *("--quick", "--targets", "ctxcache,redis", "--sizes", "4096,65536"),
        *("--clients", "1,3", "--bytes-per-phase", "262144"),
    )
    assert data["meta"]["targets"] == ["ctxcache", "redis"] and data["meta"]["rounds"] == 3
    rows = data["results"]
    cases = {(r["target"], r["op"], r["size"], r["clients"]) for r in rows}
    assert cases == {
        (t, op, s, c)
        for t in ("ctxcache", "redis")
        for op in ("put", "get")
        for s in (4096, 65536)
        for c in (1, 3)
    }
    for r in rows:
        assert r["gbps"] > 0 and r["rounds"] == 3 and len(r["round_gbps"]) == 3
        assert r["gbps"] == sorted(r["round_gbps"])[1]  # the median round
        check_latencies(r)
    table = (out / "sidecar.md").read_text()
    assert "| GET | 64 KiB | 3 |" in table and "ctxcache GB/s" in table
    # ours against each reference round by round: the median ratio, rounds ahead of 3
    assert "ctxcache ÷ redis, paired (rounds ahead)" in table
    assert re.search(r"\| GET \| 64 KiB \| 3 \|.* \| \d+\.\d\d \([0-3]/3\) \|\n", table)


def test_benchmarks_doc_names_command_machine_date_and_plot() -> None:
    """Each `## ... (`ctxcache bench NAME`)` section of docs/benchmarks.md says how its
    numbers were made and shows a plot that exists."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    text = (docs / "benchmarks.md").read_text()
    sections = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    benches = {}
    for section in sections:
        title = section.splitlines()[0]
        if m := re.search(r"\(`ctxcache bench (\w+)`\)", title):
            benches[m.group(1)] = section
    assert {
        "capacity",
        "multiturn",
        "gateway",
        "sidecar",
        "worker",
        "manager",
        "load",
    } <= benches.keys()
    for name, section in benches.items():
        assert f"**Command:** `ctxcache bench {name}" in section, name
        assert "**Machine:**" in section and "CPU" in section, name
        assert re.search(r"\*\*Date:\*\* 20\d\d-\d\d-\d\d \d\d:\d\d", section), name
        images = re.findall(r"!\[[^\]]*\]\((img/[^)]+\.png)\)", section)
        assert images, f"{name}: no plot"
        for image in images:
            check_png(docs / image)
