"""`ctxcache worker --model DIR --port 8100 [--sidecar lm://HOST:PORT] [--chunk-size 256]`."""

from __future__ import annotations

import argparse
import sys

# settings field -> flag dest (flags left unset keep the CTX_WORKER_* env value or default)
FLAGS = {
    "model": "model",
    "model_name": "model_name",
    "host": "host",
    "port": "port",
    "dtype": "dtype",
    "threads": "threads",
    "sidecar": "sidecar",
    "sidecar_timeout": "sidecar_timeout",
    "sidecar_local_dir": "sidecar_local_dir",
    "chunk_size": "chunk_size",
    "l1_bytes": "l1_bytes",
    "worker_id": "worker_id",
    "max_queue": "max_queue",
    "max_batch": "max_batch",
    "sink_tokens": "sink_tokens",
    "window_tokens": "window_tokens",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="local HF model directory or hub id (required)")
    parser.add_argument(
        "--model-name",
        "--served-model-name",
        dest="model_name",
        help="model name in the API (default: the directory name)",
    )
    parser.add_argument("--host", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="HTTP port (default 8100)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="default float32")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--sidecar", help="KV sidecar, lm://HOST:PORT (optional)")
    parser.add_argument("--sidecar-timeout", type=float, help="seconds per sidecar call (1.0)")
    parser.add_argument(
        "--sidecar-local-dir",
        metavar="DIR",
        help="the sidecar's --local-dir on this node: KV through its shared memory (optional)",
    )
    parser.add_argument("--chunk-size", type=int, help="sidecar chunk tokens (default 256)")
    parser.add_argument("--l1-bytes", type=int, help="in-process KV cache budget (1 GiB)")
    parser.add_argument("--worker-id", type=int, help="worker id in LMCache keys (default 0)")
    parser.add_argument("--max-queue", type=int, help="waiting requests before 503 (64)")
    parser.add_argument("--max-batch", type=int, help="sequences decoded together (8)")
    parser.add_argument(
        "--sink-tokens", type=int, help="attention-sink window: keep the first S prompt tokens"
    )
    parser.add_argument(
        "--window-tokens", type=int, help="attention-sink window: and the last W (changes outputs)"
    )


def main(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from ctxcache import tracing
    from ctxcache.logs import setup_logging
    from ctxcache.settings import from_args, serve_app
    from worker.app import create_app
    from worker.model_kind import UnsupportedModelKind, check_builtin
    from worker.settings import WorkerSettings

    setup_logging("worker")
    try:
        settings = from_args(WorkerSettings, args, **FLAGS)
    except ValidationError as exc:
        sys.stderr.write(f"ctxcache worker: invalid settings\n{exc}\n")
        return 2
    try:
        check_builtin(settings.model)
    except UnsupportedModelKind as exc:
        sys.stderr.write(f"ctxcache worker: {exc}\n")
        return 2
    tracing.configure("worker")
    app = tracing.server_middleware(create_app(settings), "worker")
    serve_app(app, host=settings.host, port=settings.port)
    return 0
