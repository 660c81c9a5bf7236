"""`ctxcache gateway`: run the OpenAI-compatible gateway."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from pathlib import Path
from typing import Any

from gateway.limits import GRAMMAR, KeyPolicy, load_keys_file, parse_key_spec, parse_key_specs

log = logging.getLogger(__name__)


def api_key_spec(spec: str) -> str:
    """`--api-key`'s type: checked here, so a bad spec stops the command with its reason
    (the message never repeats the key)."""
    try:
        parse_key_spec(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec


def add_api_key_argument(p: argparse.ArgumentParser) -> None:
    """`--api-key` and `--api-keys-file` (`ctxcache gateway` and `ctxcache serve`)."""
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        type=api_key_spec,
        metavar=GRAMMAR,
        help="an API key, its tenant and optionally its requests (rpm) and tokens (tpm) "
        "per minute (repeatable; the key may hold '=' but not ':'); none: open gateway. "
        "Every user of the machine can read a command line: prefer --api-keys-file. "
        "docs/limits.md",
    )
    p.add_argument(
        "--api-keys-file",
        type=Path,
        default=None,
        metavar="PATH",
        help='a JSON file {"<key>": "<tenant>[:rpm=N][,tpm=N]", ...} (a key may be given as '
        '"sha256:<hex>", its SHA-256), read at start and again on SIGHUP; refused if every '
        "user can write it",
    )


def api_keys(specs: list[str]) -> dict[str, KeyPolicy]:
    """Every `--api-key`; a key given twice stops the command."""
    try:
        return parse_key_specs(specs)
    except ValueError as exc:
        raise SystemExit(f"ctxcache: --api-key: {exc}") from None


def api_keys_file(path: Path, specs: list[str] | None) -> Path:
    """`--api-keys-file`, absolute, once read: a file that cannot be used, or keys given on
    the command line too, stop the command."""
    if specs:
        raise SystemExit("ctxcache: --api-key and --api-keys-file: give the keys one way")
    try:
        load_keys_file(path)
    except ValueError as exc:
        raise SystemExit(f"ctxcache: --api-keys-file: {exc}") from None
    return path.resolve()


def reload_keys_on_hangup(app: Any, path: Path) -> None:
    """SIGHUP: the gateway reads its keys file again (`KeyRing.reload`). The handler only
    starts the reload on the event loop, which reads the file in a thread and swaps the
    keys in between requests."""
    running: set[asyncio.Task[bool]] = set()  # (a task nothing refers to may be collected)

    def reload(loop: asyncio.AbstractEventLoop) -> None:
        ring = getattr(app.state, "keys", None)  # set by the app's lifespan
        if ring is None:
            log.warning("SIGHUP before the gateway started: its keys file is read as it starts")
            return
        task = loop.create_task(ring.reload(path), name="keys-reload")
        running.add(task)
        task.add_done_callback(running.discard)

    def on_hangup(signum: int, frame: object) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not serving (yet, or any more)
            return
        loop.call_soon_threadsafe(reload, loop)

    signal.signal(signal.SIGHUP, on_hangup)


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
    add_api_key_argument(p)
    p.add_argument("--log-level", default=None)


def main(args: argparse.Namespace) -> int:
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from ctxcache import tracing
    from ctxcache.logs import setup_logging
    from ctxcache.settings import from_args, serve_app
    from gateway.app import create_app
    from gateway.settings import GatewaySettings

    if args.api_key is not None:
        args.api_keys = api_keys(args.api_key)
    try:
        settings = from_args(
            GatewaySettings,
            args,
            host="host",
            port="port",
            workers="worker",
            manager_url="manager_url",
            redis_url="redis_url",
            api_keys="api_keys",
            api_keys_file="api_keys_file",
            log_level="log_level",
        )
    except ValidationError as exc:
        raise SystemExit(f"ctxcache gateway: bad settings: {settings_errors(exc)}") from None
    except SettingsError as exc:  # e.g. a CTX_GATEWAY_* variable that is not valid JSON
        raise SystemExit(f"ctxcache gateway: bad settings: {exc}") from None
    setup_logging("gateway", settings.log_level)
    tracing.configure("gateway")  # before the app: its clients look at it once
    gateway = create_app(settings, freeze_heap=True)
    if settings.api_keys_file is not None:
        reload_keys_on_hangup(gateway, settings.api_keys_file)
    app = tracing.server_middleware(gateway, "gateway")
    serve_app(app, host=settings.host, port=settings.port)
    return 0


def settings_errors(exc: Exception) -> str:
    """A settings error without the values (an API key is a secret): where and why. A
    key in `api_keys` is named by its tenant's spec, never by itself."""
    from pydantic import ValidationError

    assert isinstance(exc, ValidationError)
    parts = []
    for err in exc.errors(include_input=False, include_url=False):
        loc = [str(p) for p in err["loc"]]
        if loc[:1] == ["api_keys"] and len(loc) > 1:
            loc[1] = "<key>"  # the key itself
        where = ".".join(loc)
        message = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)
