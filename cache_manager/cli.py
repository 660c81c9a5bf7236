"""`ctxcache manager`: run the Context Cache Manager service."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default 8300)")
    p.add_argument("--redis-url", default=None, help="redis://host:port/db")
    p.add_argument("--token", default=None, help="shared token required on the API")
    p.add_argument("--log-level", default=None)


def main(args: argparse.Namespace) -> int:
    from cache_manager.app import create_app
    from cache_manager.settings import ManagerSettings
    from ctxcache.logs import setup_logging
    from ctxcache.settings import from_args, serve_app

    settings = from_args(
        ManagerSettings,
        args,
        host="host",
        port="port",
        redis_url="redis_url",
        token="token",
        log_level="log_level",
    )
    setup_logging("manager", settings.log_level)
    serve_app(create_app(settings), host=settings.host, port=settings.port)
    return 0
