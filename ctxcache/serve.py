"""`ctxcache serve`: the whole stack on this machine, in one command.

A bundled Redis (AOF on, files under --data-dir), the KV sidecar (disk tier under the
data dir), one CPU worker on a local model (a tiny one is created under the data dir on
first run unless --model is given), and the gateway on --port with the Context Cache
Manager running inside it. Internal services take free ports, so two stacks can run side
by side. Start-up is health-gated; Ctrl-C / SIGTERM stops everything. Services that have
not landed in this checkout yet are skipped (the manager then runs as its own service).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from pathlib import Path

log = logging.getLogger("ctxcache.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    p.add_argument("--port", type=int, default=8000, help="gateway port")
    p.add_argument("--data-dir", type=Path, default=Path(".ctxcache"))
    p.add_argument("--model", default=None, help="local HF model dir (default: tiny preset)")
    p.add_argument("--sidecar-memory-bytes", type=int, default=512 * 2**20)
    p.add_argument("--sidecar-disk-bytes", type=int, default=4 * 2**30)


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def main(args: argparse.Namespace) -> int:
    from ctxcache.logs import setup_logging
    from ctxcache.net import free_port
    from ctxcache.redis_server import RedisServer
    from ctxcache.supervisor import Child, Supervisor, http_ready

    setup_logging("serve")
    data = args.data_dir.resolve()
    data.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "ctxcache.cli"]
    sup = Supervisor()
    try:
        redis = RedisServer(data / "redis")
        redis.data_dir.mkdir(parents=True, exist_ok=True)
        sup.start(Child("redis", redis.argv(), ready=redis.wait_ready))
        gateway_env: dict[str, str] = {}

        workers: list[str] = []
        sidecar_control = ""
        if _have("sidecar.app") or _have("sidecar.server"):
            data_port, control_port = free_port(), free_port()
            sup.start(
                Child(
                    "sidecar",
                    [
                        *cli,
                        "sidecar",
                        "--port",
                        str(data_port),
                        "--control-port",
                        str(control_port),
                        "--data-dir",
                        str(data / "sidecar"),
                        "--memory-bytes",
                        str(args.sidecar_memory_bytes),
                        "--disk-bytes",
                        str(args.sidecar_disk_bytes),
                    ],
                    ready=http_ready(f"http://127.0.0.1:{control_port}/health"),
                )
            )
            sidecar_control = f"http://127.0.0.1:{control_port}"
            sidecar_url = f"lm://127.0.0.1:{data_port}"
        if _have("worker.app"):
            model = args.model or str(_default_model(data))
            worker_port = free_port()
            argv = [*cli, "worker", "--model", model, "--port", str(worker_port)]
            if sidecar_control:
                argv += ["--sidecar", sidecar_url]
            sup.start(
                Child("worker", argv, ready=http_ready(f"http://127.0.0.1:{worker_port}/health"))
            )
            workers.append(
                f"http://127.0.0.1:{worker_port}"
                + (f"={sidecar_control}" if sidecar_control else "")
            )

        if _have("gateway.app"):
            argv = [
                *cli,
                "gateway",
                "--host",
                args.host,
                "--port",
                str(args.port),
                "--redis-url",
                redis.url,
            ]
            for w in workers:
                argv += ["--worker", w]
            sup.start(
                Child(
                    "gateway",
                    argv,
                    env=gateway_env,
                    ready=http_ready(f"http://127.0.0.1:{args.port}/health"),
                )
            )
            where = f"http://{args.host}:{args.port}"
        else:
            port = args.port
            sup.start(
                Child(
                    "manager",
                    [*cli, "manager", "--port", str(port), "--redis-url", redis.url],
                    ready=http_ready(f"http://127.0.0.1:{port}/health"),
                )
            )
            where = f"http://127.0.0.1:{port} (manager API; the gateway has not landed yet)"
        log.info("ctxcache is up: %s  (data in %s; Ctrl-C stops)", where, data)
        print(
            f"\n  ctxcache is serving on {where}\n  try: curl {where.split()[0]}/health\n",
            flush=True,
        )
        return sup.wait()
    except (RuntimeError, TimeoutError) as exc:
        log.error("start-up failed: %s", exc)
        return 1
    finally:
        sup.stop()
        log.info("stopped")


def _default_model(data: Path) -> Path:
    """A tiny model built under the data dir on first run (no download needed)."""
    target = data / "models" / "tiny"
    if not (target / "config.json").exists():
        from worker.presets.model import create_model

        log.info("creating the tiny model in %s (first run)", target)
        create_model("tiny", target)
    return target
