"""`ctxcache bench cold-kv`: the sidecar's fp8 cold tiers (`--cold-kv fp8`) against plain
ones, on the same conversations, side by side in one run.

For each model dtype (bf16, fp32) and each conversation (a seeded history of `--context`
tokens, then a new user turn of `--turn` tokens), the built-in worker's model
(`worker.engine.runner.ModelRunner`, the `small` preset) prefills the history once; its KV
goes, as the worker stores it (LMCache `KV_2LTD` chunks of `--chunk-size` tokens, tagged with
the conversation), into four `ctxcache sidecar` processes: plain and fp8, each with the
blocks in memory, or on disk only (`--memory-bytes 1`: every block goes straight to disk and
is read from there on every GET). Then, per sidecar:
- **bytes per session** (the sidecar's own count, `GET /sessions/{key}`) and sessions per GB;
- **load time**: the client's GETs of every chunk and their conversion to the worker's KV
  tensor (an fp8 sidecar unpacks inside its GET), median over `--reps`, beside a plain copy
  of the same bytes;
- **the next turn answered from that KV**, against the answer from the exact KV (the plain
  sidecars' KV is checked to be that, bit for bit): the model is fed the exact answer's
  `--answer` greedy tokens after the loaded KV, and at each step its log-probabilities over
  the whole vocabulary are compared: max and mean |Δ logprob|, KL(exact ‖ loaded), top-1
  agreement. Its own greedy answer is the exact one up to the first step whose top-1 differs
  (the inputs are the same until then): "tokens until the first difference", and whether the
  whole answer is the same. A case whose loaded KV equals one already run (a disk tier's and
  its memory tier's) shares that run's answer.
The same comparison is made for per-chunk scales (one per layer, K/V and chunk, packed here
with `sidecar.coldkv.pack(granularity="chunk")`, not by a sidecar) to weigh the two choices.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

DTYPES = ("bfloat16", "float32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from benchmarks.lib.util import add_output_arguments

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ctxcache"
    parser.add_argument(
        "--model",
        type=Path,
        default=cache / "models" / "small",
        help="model dir (the `small` preset is built there if missing)",
    )
    add_output_arguments(parser, "cold-kv")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024, help="history tokens")
    parser.add_argument("--turn", type=int, default=32, help="new user tokens")
    parser.add_argument("--answer", type=int, default=32, help="greedy tokens compared")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5, help="timed loads per sidecar, median")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument(
        "--quick", action="store_true", help="2 conversations, 512 tokens, 1 dtype, 2 reps"
    )


def main(args: argparse.Namespace) -> int:
    import torch

    from benchmarks.coldkv.coldkv_report import write_report
    from benchmarks.coldkv.coldkv_run import Sidecars, run_dtype
    from benchmarks.lib.util import ensure_preset, plot_path, run_meta
    from ctxcache.logs import setup_logging

    setup_logging("bench", "WARNING")
    if args.quick:
        args.conversations, args.context, args.reps = 2, 512, 2
        args.dtypes = args.dtypes[:1]
    torch.set_num_threads(args.threads)
    ensure_preset("small", args.model)
    meta = run_meta(
        "cold-kv",
        model=str(args.model),
        dtypes=args.dtypes,
        conversations=args.conversations,
        context=args.context,
        turn=args.turn,
        answer=args.answer,
        chunk_size=args.chunk_size,
        reps=args.reps,
    )
    results = []
    with (
        tempfile.TemporaryDirectory(prefix="ctxcache-bench-coldkv-") as tmp,
        Sidecars(Path(tmp)) as sidecars,
    ):
        for dtype in args.dtypes:
            results.append(run_dtype(args, dtype, sidecars))
    for path in write_report(args.out, meta, results, plot_path(args, "cold-kv")):
        sys.stdout.write(f"{path}\n")
    return 0
