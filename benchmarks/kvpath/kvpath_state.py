"""`ctxcache bench kvpath --state SHAPES`: a hybrid model's recurrent-state block through the
connector's state side (`vllm_connector.state_worker.StateSide`), beside a plain copy of the
same bytes (docs/vllm.md, "Hybrid models: recurrent state").

Per shape, the state tensors are laid out as vLLM lays them out: per layer one raw page
buffer `[blocks, page bytes]` (the page padded as vLLM pads a state page), the conv state
and the recurrent state strided views into it. Each round times, back to back: a plain copy
of one block's bytes (host to host), `read` (the block's tensors gathered to one host
buffer: what a store copies out in vLLM's step), `write` (the inverse), a PUT of the block
to the sidecar (and a round trip after it, so the sidecar holds it) and a load (GET and
`write`). The sidecar runs in its own process. Every load is checked against the block it
was stored from. Medians over the rounds; "÷ plain copy" is the op's rate over the copy's
in the same round.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class StateShape:
    name: str
    layers: int
    conv: tuple[int, int]  # (kernel - 1, conv channels), bfloat16
    ssm: tuple[int, int, int]  # (value heads, head dim, head dim), float32
    pad: float = 0.1  # the page's padding (vLLM pads a state page to an attention page)


STATE_SHAPES = {
    # `tiny-hybrid` (ctxcache's preset): 2 gated-delta-net layers
    "tiny-hybrid": StateShape("tiny-hybrid (2 delta-net layers)", 2, (3, 1024), (4, 128, 128)),
    # Qwen3-Next-80B-A3B's published config: 36 delta-net layers, 32 value heads of 128,
    # conv over 2 x 16 key heads + 32 value heads of 128 (8,192 channels), kernel 4
    "qwen3-next-80b": StateShape("Qwen3-Next-80B (36 layers)", 36, (3, 8192), (32, 128, 128)),
    "qwen3-next-80b-tp4": StateShape(
        "Qwen3-Next-80B, one of 4 ranks", 36, (3, 2048), (8, 128, 128)
    ),
}
BLOCKS = 8
WARMUP = 2  # rounds run first and not counted (first touches of the pages and buffers)


def run(args: argparse.Namespace) -> int:
    """`--state`: each shape's rounds, then the table, JSON and plot."""
    from tqdm import tqdm

    from benchmarks.kvpath.kvpath import start_sidecar
    from benchmarks.lib.util import plot_path, run_meta, write_outputs
    from ctxcache.logs import setup_logging

    setup_logging("bench", "WARNING")
    names = [s for s in args.state.split(",") if s]
    if not names or set(names) - set(STATE_SHAPES):
        raise SystemExit(f"--state {args.state!r}: a comma list of {', '.join(STATE_SHAPES)}")
    shapes = [STATE_SHAPES[n] for n in names]
    meta = run_meta("kvpath", state=names, rounds=args.rounds, warmup=WARMUP)
    with start_sidecar(max(block_bytes(s) for s in shapes) * 4) as (url, _local):
        bar = tqdm(total=len(shapes) * (WARMUP + args.rounds), desc="kvpath state", unit="round")
        rows = [run_state_case(s, url, args.rounds, bar) for s in shapes]
        bar.close()
    data = {"meta": meta, "results": rows}
    write_outputs(Path(args.out), "kvpath", data, markdown(rows))
    cpu = meta["machine"].get("cpu_class") or "CPU class unknown"
    title = f"a recurrent-state block through the connector ÷ a plain copy ({cpu})"
    plot(rows, plot_path(args, "kvpath"), title)
    return 0


def block_bytes(shape: StateShape) -> int:
    conv = shape.conv[0] * shape.conv[1] * 2
    ssm = shape.ssm[0] * shape.ssm[1] * shape.ssm[2] * 4
    return shape.layers * (conv + ssm)


def state_tensors(shape: StateShape) -> list[Any]:
    """Every layer's conv and recurrent state, strided views of its own page buffer."""
    import torch

    conv = shape.conv[0] * shape.conv[1] * 2
    ssm = shape.ssm[0] * shape.ssm[1] * shape.ssm[2] * 4
    page = int((conv + ssm) * (1 + shape.pad)) // 64 * 64 + 64
    out = []
    for _ in range(shape.layers):
        raw = torch.randint(0, 255, (BLOCKS, page), dtype=torch.uint8)
        out.append(raw[:, :conv].view(torch.bfloat16).view(BLOCKS, *shape.conv))
        out.append(raw[:, conv : conv + ssm].view(torch.float32).view(BLOCKS, *shape.ssm))
    return out


def run_state_case(shape: StateShape, url: str, rounds: int, bar: Any) -> dict[str, Any]:
    import torch

    from vllm_connector.config import ConnectorConfig
    from vllm_connector.state_worker import StateSide

    tensors = state_tensors(shape)
    side = StateSide(ConnectorConfig(sidecar_url=url, timeout_s=30))
    side.register({f"l{i}": tensors[2 * i : 2 * i + 2] for i in range(shape.layers)})
    nbytes = side.block_bytes
    a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    b = torch.empty_like(a)
    key = f"bench#g0@1@0@{shape.layers:x}@bfloat16@rs%1.bench@s%kvpath"
    times: dict[str, list[float]] = {op: [] for op in ("copy", "read", "write", "put", "load")}
    data = side.read(1)
    ops: dict[str, Callable[[], object]] = {
        "copy": lambda: b.copy_(a),
        "read": lambda: side.read(1),
        "write": lambda: side.write(2, data),
        "put": lambda: _put(side, key, data),
        "load": lambda: side.load_one("r", key, 3),
    }
    try:
        for i in range(WARMUP + rounds):
            took = {op: _timed(fn) for op, fn in ops.items()}
            if side.take_loaded_blocks() != {"r": False}:
                raise AssertionError("the state load failed")
            if not torch.equal(side.read(3), data):
                raise AssertionError("the loaded state differs from the stored one")
            if i >= WARMUP:
                for op, t in took.items():
                    times[op].append(t)
            bar.update(1)
    finally:
        side.close()
    med = {op: statistics.median(t) for op, t in times.items()}
    rows = {
        op: {
            "ms": med[op] * 1e3,
            "gb_s": nbytes / med[op] / 1e9,
            "vs_copy": statistics.median(
                c / t for c, t in zip(times["copy"], times[op], strict=True)
            ),
        }
        for op in ("read", "write", "put", "load")
    }
    return {"shape": shape.name, "bytes": nbytes, "copy_gb_s": nbytes / med["copy"] / 1e9} | {
        "ops": rows
    }


def _put(side: Any, key: str, data: Any) -> None:
    side.put_one("kvpath", key, data)
    side.round_trip()  # PUT has no reply: until the sidecar holds it


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| state shape | bytes per block | op | ms | GB/s | ÷ plain copy |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['bytes']:,} | plain copy | "
            f"{r['bytes'] / r['copy_gb_s'] / 1e6:.3f} | {r['copy_gb_s']:.2f} | 1 |"
        )
        for op, label in (
            ("read", "read (out of the pages)"),
            ("write", "write (into the pages)"),
            ("put", "PUT over lm://"),
            ("load", "load: GET over lm:// and write"),
        ):
            o = r["ops"][op]
            lines.append(f"| | | {label} | {o['ms']:.3f} | {o['gb_s']:.2f} | {o['vs_copy']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Any, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = ("read", "write", "put", "load")
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / max(len(rows), 1)
    for k, r in enumerate(rows):
        xs = [i + k * width for i in range(len(ops))]
        ax.bar(xs, [r["ops"][op]["vs_copy"] for op in ops], width, label=r["shape"])
    ax.set_xticks([i + width * (len(rows) - 1) / 2 for i in range(len(ops))], ops)
    ax.set_ylabel("rate ÷ a plain copy")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
