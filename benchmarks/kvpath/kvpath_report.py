"""The rows, tables and plot of `ctxcache bench kvpath` (kvpath.py): one row per case and
operation from its timed rounds (`rows_of`), the Markdown (`markdown`, with the CUDA table
of `CudaProbe`'s columns, `cuda_markdown`) and the plot (`plot`)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.kvpath.kvpath import Shape


def rows_of(
    shape: Shape,
    tokens: int,
    path: str,
    layout: str,
    nbytes: int,
    s: dict[str, list[float]],
    counters: dict[str, int],
) -> list[dict[str, Any]]:
    def ratio(op: str, ref: str) -> float:
        return statistics.median(c / t for t, c in zip(s[op], s[ref], strict=True))

    out = []
    for op, ref in (("load", "copy_load"), ("store", "copy_store"), ("get", "copy_load")):
        if not s[op]:
            continue
        t = statistics.median(s[op])
        row = {
            "shape": shape.name,
            "layers": shape.layers,
            "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "tokens": tokens,
            "bytes": nbytes,
            "bytes_per_token": nbytes // tokens,
            "latent": shape.latent,
            "layout": layout,
            "path": path,
            "op": op,
            "seconds": t,
            "round_seconds": s[op],
            "gbps": nbytes / t / 1e9,
            "ms_per_1k_tokens": t * 1e3 * 1000 / tokens,
            "copy_gbps": nbytes / statistics.median(s[ref]) / 1e9,
            "vs_copy": ratio(op, ref),
            "counters": counters,
        }
        if op == "load" and s["get"]:
            row["vs_get"] = statistics.median(
                g / t for t, g in zip(s["load"], s["get"], strict=True)
            )
        out.append(row)
    return out


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    from benchmarks.lib.util import markdown_table

    where = "pinned host↔device" if meta["device"] == "cuda" else "torch host"
    head = [
        "KV shape",
        "KV dtype",
        "tokens",
        "B / token",
        "MB",
        "path",
        "op",
        "GB/s",
        "ms / 1k tokens",
        f"plain copy GB/s ({where})",
        "÷ plain copy",
        "load ÷ its GET",
    ]
    body = [
        [
            r["shape"],
            r.get("dtype", meta["dtype"]),
            r["tokens"],
            r.get("bytes_per_token", r["bytes"] // r["tokens"]),
            r["bytes"] / 1e6,
            r["path"],
            r["op"] if r["op"] != "get" else "GET alone",
            r["gbps"],
            r["ms_per_1k_tokens"],
            r["copy_gbps"],
            f"{r['vs_copy']:.3f}",
            f"{r['vs_get']:.2f}" if "vs_get" in r else "",
        ]
        for r in rows
    ]
    sizes = sorted({r["block_tokens"] for r in rows if "block_tokens" in r})
    if isinstance(meta["block_tokens"], list) or len(sizes) > 1:  # several: a column
        head.insert(1, "N")
        for line, r in zip(body, rows, strict=True):
            line.insert(1, r.get("block_tokens", ""))
    layouts = sorted({r["layout"] for r in rows})
    block_tokens = meta["block_tokens"]
    if sizes:  # what the rows ran (MLA shapes: 16 on CPU by default)
        block_tokens = ",".join(map(str, sizes))
    elif isinstance(block_tokens, list):
        block_tokens = ",".join(map(str, block_tokens))
    return (
        markdown_table(head, body)
        + f"\n\nCache layout: {', '.join(layouts)}; {block_tokens}-token kernel blocks, "
        f"{meta['chunk_tokens']}-token chunks, {meta['dtype']}, device {meta['device']}"
        + (f" ({meta['device_name']})" if meta.get("device_name") else "")
        + f"; medians of {meta['rounds']} rounds, ratios paired per round.\n"
        + cuda_markdown(rows)
    )


def cuda_markdown(rows: list[dict[str, Any]]) -> str:
    """(CUDA) The copies' GPU time against a pinned copy's, the wall time's parts, and peak
    device memory beside the ring's size; empty where no row has them (CPU)."""
    from benchmarks.lib.util import markdown_table

    cuda = [r for r in rows if "gpu_seconds" in r]
    if not cuda:
        return ""
    head = [
        "KV shape",
        "N",
        "path",
        "op",
        "GPU ms (events)",
        "pinned copy GPU ms",
        "copy ÷ GPU time",
        "lease ms",
        "copies ms",
        "release ms",
        "peak device MiB",
        "ring MiB",
    ]
    body = [
        [
            r["shape"],
            r["block_tokens"],
            r["path"],
            r["op"],
            r["gpu_seconds"] * 1e3,
            r["gpu_copy_seconds"] * 1e3,
            f"{r['gpu_vs_copy']:.3f}" if r["gpu_vs_copy"] else "",
            r["lease_seconds"] * 1e3,
            r["copies_seconds"] * 1e3,
            r["release_seconds"] * 1e3,
            r["peak_device_bytes"] / 2**20,
            r["ring_bytes"] / 2**20,
        ]
        for r in cuda
    ]
    return (
        "\n**On the GPU** (lease = `lease` or `alloc`, release = `release` or `commit`: the "
        "sidecar's round trips; copies = the rest of the wall time; peak device memory "
        "beyond what was allocated before the operation):\n\n" + markdown_table(head, body) + "\n"
    )


def plot(rows: list[dict[str, Any]], path: Path, meta: dict[str, Any]) -> None:
    from benchmarks.lib.util import bar_plot

    cases = [r for r in rows if r["op"] in ("load", "store")]
    several = len({r.get("dtype") for r in cases}) > 1  # (--dtype a list: one bar each)

    def label(r: dict[str, Any]) -> str:
        return f"{r['shape']} {r['dtype']} {r['op']}" if several else f"{r['shape']} {r['op']}"

    labels = sorted({label(r) for r in cases})
    series: dict[str, list[float]] = {}
    for p in sorted({r["path"] for r in cases}):
        by = {label(r): r["vs_copy"] for r in cases if r["path"] == p}
        series[p] = [by.get(name, 0.0) for name in labels]
    bar_plot(
        path,
        f"KV load/store through the connector ÷ a plain copy of the same bytes ({meta['device']})",
        labels,
        series,
        "fraction of a plain copy (1.0 = memory speed)",
    )
