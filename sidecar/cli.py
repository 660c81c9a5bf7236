"""`ctxcache sidecar`: the KV sidecar (data port + control API in one process)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--host", help="bind address for both ports (default 127.0.0.1)")
    a("--port", type=int, help="data port, LMCache lm:// protocol (default 65432)")
    a("--control-port", type=int, help="control HTTP API port (default 8200)")
    a("--data-dir", help="directory of the disk tier and the saved pins")
    a("--memory-bytes", type=int, help="memory tier budget in bytes (default 4 GiB)")
    a("--disk-bytes", type=int, help="disk tier budget in bytes (default 0: no disk tier)")
    a(
        "--pin-policy",
        choices=("lru", "reserve"),
        help="lru (default): pinned sessions compete by recency; reserve: first come, first "
        "served, new pinned blocks refused once pinned bytes reach memory + disk",
    )
    a(
        "--local-dir",
        help="memory-backed directory shared with engines on this node (/dev/shm/..., a "
        "tmpfs volume): the memory tier lives in a shared region there and local engines "
        "copy KV through it instead of the socket (env CTX_SIDECAR_LOCAL_DIR)",
    )
    a("--local-bytes", type=int, help="size of the shared region (default memory bytes x 1.125)")
    a(
        "--cold-kv",
        choices=("off", "fp8"),
        help="fp8: keep bf16/fp16/fp32 KV as fp8 with per-row scales in memory and on disk "
        "(about half the bytes; lossy; off by default; env CTX_SIDECAR_COLD_KV)",
    )
    a(
        "--state-blocks-per-session",
        type=int,
        help="a session's newest recurrent-state blocks kept (a hybrid model's, one per turn; "
        "default 2; 0: all; env CTX_SIDECAR_STATE_BLOCKS_PER_SESSION)",
    )
    a("--token", help="bearer token the control API requires (env CTX_SIDECAR_TOKEN)")
    a(
        "--encryption-key",
        help="base64 32-byte AES-256-GCM key for the disk tier (env CTX_SIDECAR_ENCRYPTION_KEY)",
    )
    a("--log-level", help="DEBUG, INFO, WARNING...")


def main(args: argparse.Namespace) -> int:
    from ctxcache import tracing
    from ctxcache.logs import setup_logging
    from ctxcache.settings import from_args, serve_app
    from sidecar.app import create_app
    from sidecar.settings import SidecarSettings

    settings = from_args(
        SidecarSettings,
        args,
        host="host",
        port="port",
        control_port="control_port",
        data_dir="data_dir",
        memory_bytes="memory_bytes",
        disk_bytes="disk_bytes",
        pin_policy="pin_policy",
        local_dir="local_dir",
        local_bytes="local_bytes",
        token="token",
        encryption_key="encryption_key",
        cold_kv="cold_kv",
        state_blocks_per_session="state_blocks_per_session",
        log_level="log_level",
    )
    setup_logging("sidecar", settings.log_level)
    tracing.configure("sidecar")  # (on with OTEL_EXPORTER_OTLP_ENDPOINT) control API, local socket
    app = tracing.server_middleware(create_app(settings), "sidecar")
    serve_app(app, host=settings.host, port=settings.control_port)
    return 0
