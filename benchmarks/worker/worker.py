"""`ctxcache bench worker`: TTFT of a turn whose history is cached vs fully recomputed.

For each context size C, one history of C tokens is prefilled once (its KV lands in the L1
and the sidecar), then turns of C + `--new-tokens` tokens are timed, side by side:
- full recompute: nothing cached (L1 cleared, a session tag the sidecar has never seen);
- sidecar hit: L1 cleared, the history's chunks come from the sidecar (`GET`);
- L1 hit: the history's 16-token blocks are in the in-process L1;
- floor: prefilling the new tokens alone with the history's KV already in memory.
TTFT is measured in process, from submitting the request to its first token.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

CASES = ("full", "sidecar", "l1", "floor")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from benchmarks.lib.util import add_output_arguments

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ctxcache"
    parser.add_argument(
        "--model",
        type=Path,
        default=cache / "models" / "small",
        help="model dir (the `small` preset is built there if missing)",
    )
    add_output_arguments(parser, "worker")
    parser.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        help="history sizes in tokens (250 500 1000 2000; 250 1000 --quick)",
    )
    parser.add_argument("--new-tokens", type=int, default=100)
    parser.add_argument("--reps", type=int, help="timed turns per case, median (5; 1 --quick)")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--sidecar", help="use this lm://HOST:PORT instead of starting one")
    parser.add_argument(
        "--quick", action="store_true", help="contexts 250 and 1000, 1 rep (explicit options win)"
    )
    parser.add_argument(
        "--no-tail-blocks",
        action="store_true",
        help="full sidecar chunks only, as vLLM + LMCache reuse them",
    )


def main(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.lib.util import ensure_preset, plot_path, run_meta
    from benchmarks.worker.worker_report import write_report
    from ctxcache.logs import setup_logging

    setup_logging("bench", "WARNING")
    if args.contexts is None:
        args.contexts = [250, 1000] if args.quick else [250, 500, 1000, 2000]
    if args.reps is None:
        args.reps = 1 if args.quick else 5
    torch.set_num_threads(args.threads)
    ensure_preset("small", args.model)
    meta = run_meta(
        "worker",
        model=str(args.model),
        contexts=args.contexts,
        new_tokens=args.new_tokens,
        chunk_size=args.chunk_size,
        reps=args.reps,
        tail_blocks=not args.no_tail_blocks,
    )
    with _sidecar(args.sidecar) as url:
        rows = _run(args, url)
    for path in write_report(args.out, meta, rows, plot_path(args, "worker")):
        sys.stdout.write(f"{path}\n")
    return 0


class _sidecar:
    """A `ctxcache sidecar` of our own on free ports (or the one given)."""

    def __init__(self, url: str | None) -> None:
        self.url, self.proc, self.tmp = url, None, None

    def __enter__(self) -> str:
        if self.url:
            return self.url
        from benchmarks.lib.process import Process
        from benchmarks.lib.stack import sidecar_service

        self.tmp = tempfile.TemporaryDirectory(prefix="ctxcache-bench-")
        service, port = sidecar_service(args=["--data-dir", self.tmp.name])
        self.proc = Process(service.argv, port=service.port, startup_timeout=60).start()
        return f"lm://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.stop()
        if self.tmp is not None:
            self.tmp.cleanup()


def _run(args: argparse.Namespace, sidecar_url: str) -> list[dict[str, Any]]:
    import torch
    from tqdm import tqdm

    from worker.engine.engine import Engine
    from worker.engine.request import Request, SamplingParams
    from worker.engine.runner import ModelRunner, kv_of_row
    from worker.kv.hashing import KeyMaker
    from worker.kv.l1 import L1Cache
    from worker.kv.layout import TORCH_TO_KEY_NAME
    from worker.kv.manager import KVManager
    from worker.kv.sidecar import SidecarKV, kv_client_factory

    runner = ModelRunner(str(args.model), "float32")
    side = SidecarKV(kv_client_factory(sidecar_url, 2.0), runner.kv_shape)
    keys = KeyMaker(args.model.name, TORCH_TO_KEY_NAME[runner.kv_shape.dtype], 0)
    kv = KVManager(
        L1Cache(4 << 30), side, keys, args.chunk_size, tail_blocks=not args.no_tail_blocks
    )
    engine = Engine(runner, kv)
    engine.start()
    rng = torch.Generator().manual_seed(0)
    allowed = torch.arange(runner.vocab_size)[3:]

    def ids(n: int) -> list[int]:
        return allowed[torch.randint(0, len(allowed), (n,), generator=rng)].tolist()

    def ttft(prompt: list[int], tag: str, max_tokens: int = 1) -> tuple[float, int]:
        events: queue.Queue[Any] = queue.Queue()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request = Request(
            uuid.uuid4().hex, prompt, params, events.put, tags=(("s", tag),), session=tag
        )
        start = time.perf_counter()
        engine.submit(request)
        events.get(timeout=600)
        took = time.perf_counter() - start
        engine.wait_idle()
        return took, request.cached_tokens

    def floor(history: list[int], history_kv: torch.Tensor) -> float:
        """Prefill the new tokens alone, the history's KV already in memory."""
        start = time.perf_counter()
        runner.prefill(history + ids(args.new_tokens), history_kv)
        return time.perf_counter() - start

    rows: list[dict[str, Any]] = []
    try:
        ttft(ids(64), "warmup")
        bar = tqdm(total=len(args.contexts) * args.reps, desc="worker TTFT", unit="turn")
        for context in args.contexts:
            tag = f"bench-{context}"
            history = ids(context)
            ttft(history, tag, max_tokens=0)  # store the history's KV (L1 + sidecar)
            with torch.inference_mode():
                _, cache = runner.prefill([*history, 0], None)
            history_kv = kv_of_row(cache, 0, 0, context)
            times: dict[str, list[float]] = {c: [] for c in CASES}
            ratios: dict[str, list[float]] = {"sidecar": [], "l1": []}
            cached: dict[str, int] = {"floor": context}

            for rep in range(args.reps):
                # the cached cases sit between two floor runs, so that machine noise
                # hits both sides of each ratio alike
                before = floor(history, history_kv)
                kv.l1.clear()
                t_side, cached["sidecar"] = ttft(history + ids(args.new_tokens), tag)
                kv.l1.clear()
                ttft(history, tag, max_tokens=0)  # the history (only) back into the L1
                t_l1, cached["l1"] = ttft(history + ids(args.new_tokens), tag)
                after = floor(history, history_kv)
                kv.l1.clear()
                t_full, cached["full"] = ttft(
                    history + ids(args.new_tokens), f"cold-{context}-{rep}"
                )
                rep_floor = (before + after) / 2
                for case, t in (
                    ("sidecar", t_side),
                    ("l1", t_l1),
                    ("full", t_full),
                    ("floor", rep_floor),
                ):
                    times[case].append(t)
                ratios["sidecar"].append(t_side / rep_floor)
                ratios["l1"].append(t_l1 / rep_floor)
                bar.update()
            rows.append(
                {
                    "context_tokens": context,
                    **{f"{c}_s": statistics.median(times[c]) for c in CASES},
                    **{f"{c}_min_s": min(times[c]) for c in CASES},
                    **{f"{c}_over_floor": statistics.median(r) for c, r in ratios.items()},
                    **{f"{c}_cached_tokens": cached[c] for c in CASES},
                }
            )
        bar.close()
    finally:
        engine.stop()
    return rows
