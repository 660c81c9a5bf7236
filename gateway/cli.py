"""`ctxcache gateway`: run the OpenAI-compatible gateway."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000)")
    p.add_argument(
        "--worker",
        action="append",
        default=None,
        metavar="[ID@]URL[=SIDECAR]",
        help="an inference worker and its sidecar's control URL (repeatable)",
    )
    p.add_argument(
        "--manager-url",
        default=None,
        help="the manager service (default: run the manager in this process on --redis-url)",
    )
    p.add_argument("--redis-url", default=None, help="Redis of the in-process manager")
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY=TENANT",
        help="an API key and its tenant (repeatable); none: open gateway",
    )
    p.add_argument("--log-level", default=None)


def main(args: argparse.Namespace) -> int:
    from ctxcache.logs import setup_logging
    from ctxcache.settings import from_args, serve_app
    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    if args.api_key is not None:
        args.api_keys = dict(k.split("=", 1) for k in args.api_key)
    settings = from_args(
        GatewaySettings,
        args,
        host="host",
        port="port",
        workers="worker",
        manager_url="manager_url",
        redis_url="redis_url",
        api_keys="api_keys",
        log_level="log_level",
    )
    setup_logging("gateway", settings.log_level)
    serve_app(create_app(settings), host=settings.host, port=settings.port)
    return 0
