"""Shared pieces of the benchmark commands: timing, percentiles, output files, plots.

Every `ctxcache bench NAME` writes the same three files into `--out`
(default `bench-results/NAME`):

- `NAME.json`: `{"meta": {...}, "results": [...]}`; `meta` holds `benchmark`, `date`
  (UTC), `command` (the exact command line), `machine` (see `machine()`) and the run's
  parameters; `results` holds one object per table row;
- `NAME.md`: one line naming the command, date and machine, then the Markdown table;
- `NAME.png`: the plot (`--plot PATH` puts it elsewhere, e.g. under docs/img/).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


@dataclass
class Result:
    name: str
    concurrency: int
    ops: int
    seconds: float
    p50_ms: float
    p99_ms: float

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds if self.seconds else 0.0

    def row(self) -> dict[str, Any]:
        return {**asdict(self), "ops_per_s": round(self.ops_per_s, 1)}


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[idx]


async def measure(
    name: str,
    op: Callable[[int], Awaitable[object]],
    *,
    ops: int,
    concurrency: int,
    progress: Callable[[int], object] | None = None,
) -> Result:
    """Run `op(i)` `ops` times over `concurrency` asyncio tasks; latency per call."""
    import asyncio

    latencies: list[float] = []
    counter = iter(range(ops))

    async def runner() -> None:
        for i in counter:
            t0 = time.perf_counter()
            await op(i)
            latencies.append(time.perf_counter() - t0)
            if progress is not None:
                progress(1)

    start = time.perf_counter()
    await asyncio.gather(*(runner() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return Result(
        name,
        concurrency,
        ops,
        elapsed,
        percentile(latencies, 50) * 1e3,
        percentile(latencies, 99) * 1e3,
    )


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # (a thread that ended meanwhile)
            os.sched_setaffinity(int(tid), cpus)


def rss_mib(pid: int) -> float:
    """A process's resident memory in MiB (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def add_pin_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """`--pin/--no-pin`, on by default where there are two CPUs or more: `what` it pins."""
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=(os.cpu_count() or 1) >= 2,
        help=f"{what} (default: on where there are two CPUs or more)",
    )


def add_tiny_model_argument(parser: argparse.ArgumentParser, used_by: str) -> None:
    """`--model DIR` (alias `--model-dir`): the tiny preset, built there if missing."""
    parser.add_argument(
        "--model",
        "--model-dir",
        dest="model_dir",
        type=Path,
        default=Path(".ctxcache/models/tiny"),
        help=f"model dir {used_by} (the `tiny` preset is built there if missing)",
    )


def ensure_preset(preset: str, model: Path, *, quiet: bool = False) -> Path:
    """`model`, with the preset `preset` built there first if it holds no model yet."""
    if not (model / "config.json").exists():
        from worker.presets import create_model  # (torch and transformers: only when needed)

        if not quiet:
            sys.stderr.write(f"building the {preset} preset into {model} ...\n")
        create_model(preset, model)
    return model


def add_output_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    """`--out DIR` and `--plot PATH`, the same for every benchmark."""
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench-results") / name,
        help=f"directory for {name}.json, {name}.md and {name}.png",
    )
    parser.add_argument(
        "--plot", type=Path, default=None, help=f"PNG path (default: OUT/{name}.png)"
    )


def plot_path(args: argparse.Namespace, name: str) -> Path:
    return Path(args.plot) if args.plot else Path(args.out) / f"{name}.png"


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that started this run, as `ctxcache bench NAME ...` or `python -m
    benchmarks.NAME ...` (shell-quoted)."""
    argv = list(sys.argv if argv is None else argv)
    if argv and Path(argv[0]).name == "__main__.py":  # `python -m benchmarks.kvpath`
        argv = ["python", "-m", f"benchmarks.{Path(argv[0]).parent.name}", *argv[1:]]
    if "bench" in argv[1:]:
        argv = ["ctxcache", *argv[argv.index("bench", 1) :]]
    return shlex.join(argv)


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")


def machine() -> dict[str, Any]:
    """What a reader needs to weigh the numbers: cores, CPU, OS, Python (and torch), load;
    the CPU's class and the dtype vLLM computes in on it unless told (`ctxcache/cpu.py`)."""
    from ctxcache.cpu import choose_dtype, cpu_class, cpu_flags

    flags = cpu_flags()
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "arch": platform.machine(),
        "cpu_class": cpu_class(flags),
        "vllm_dtype": choose_dtype(flags).dtype,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    return info


def run_meta(name: str, **params: Any) -> dict[str, Any]:
    """The `meta` block of a benchmark's JSON: name, date, exact command, machine, params."""
    return {
        "benchmark": name,
        "date": utc_now(),
        "command": command_line(),
        "machine": machine(),
        **params,
    }


def describe_machine(m: dict[str, Any]) -> str:
    parts = [f"{m.get('cpus')} CPUs ({m.get('arch')})", str(m.get("platform"))]
    if m.get("cpu_class"):  # (older results have none)
        parts.append(f"{m['cpu_class']} CPU (vLLM computes in {m.get('vllm_dtype')} unless told)")
    parts.append(f"Python {m.get('python')}")
    if "torch" in m:
        n = m.get("torch_threads")
        parts.append(f"torch {m['torch']} with {n} thread{'' if n == 1 else 's'}")
    if m.get("load_avg_1m") is not None:
        parts.append(f"load average {m['load_avg_1m']} at the start")
    return ", ".join(parts)


def header(meta: dict[str, Any]) -> str:
    """The line above every table: the exact command, the date and the machine."""
    return f"`{meta['command']}` — {meta['date']}; {describe_machine(meta['machine'])}."


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(out)


def finite(value: Any) -> Any:
    """`value` with every NaN or infinite float in it replaced by None: JSON has neither (an
    empty percentile is NaN here, and `NaN` in a file is not JSON to other readers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def write_outputs(out_dir: Path, name: str, data: dict[str, Any], table: str) -> list[Path]:
    """`NAME.json` (data, strict JSON: a NaN is null) and `NAME.md` (the header line from
    data["meta"], then table)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    paths[0].write_text(json.dumps(finite(data), indent=2, allow_nan=False) + "\n")
    meta = data.get("meta")
    text = table.rstrip("\n") + "\n"
    if isinstance(meta, dict) and {"command", "date", "machine"} <= meta.keys():
        text = header(meta) + "\n\n" + text
    paths[1].write_text(text)
    return paths


def bar_plot(
    path: Path, title: str, labels: Sequence[str], series: dict[str, Sequence[float]], ylabel: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(1, len(series))
    for k, (label, values) in enumerate(series.items()):
        xs = [i + k * width for i in range(len(labels))]
        ax.bar(xs, values, width=width, label=label)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(labels))])
    ax.set_xticklabels(labels, rotation=15, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


class ChatStream:
    """A streamed chat answer read line by line: its text, the seconds to its first
    content token (the whole time when none came), the whole time, and the usage chunk."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.usage: dict[str, Any] = {}
        self.ttft = 0.0
        self.t0 = time.perf_counter()

    def line(self, line: str) -> None:
        import orjson

        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk = orjson.loads(line[6:])
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") or ""
            if piece and not self.ttft:
                self.ttft = time.perf_counter() - self.t0
            self.parts.append(piece)
        if chunk.get("usage"):
            self.usage = chunk["usage"]

    def result(self) -> tuple[str, float, float, dict[str, Any]]:
        total = time.perf_counter() - self.t0
        return "".join(self.parts), self.ttft or total, total, self.usage


def stream_chat(
    client: Any, data: bytes, on_error: str = "stream"
) -> tuple[str, float, float, dict[str, Any]]:
    """POST `data` (a streamed chat body) to `client`'s /v1/chat/completions (an
    `httpx.Client`): `ChatStream.result`."""
    reading = ChatStream()
    with client.stream("POST", "/v1/chat/completions", content=data) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{on_error}: {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            reading.line(line)
    return reading.result()
