"""The servers `ctxcache bench multiturn` replays against, started and stopped by it.

`--engine vllm` starts one vLLM per mode, all with the same model, dtype and threads, so
every mode has its own KV cache and none warms another's:

| mode | path | vLLM's KV cache |
|---|---|---|
| `vllm-full` | vLLM alone, the whole history each turn (what users have today) | `--kv-blocks` |
| `session` | ctxcache gateway → vLLM with the ctxcache connector → sidecar | `--kv-blocks` |
| `session-no-sidecar` | ctxcache gateway → vLLM without the connector | `--kv-blocks` |
| `roomy` | vLLM alone, the whole history, a cache that holds every conversation | `--roomy-gib` |
| `vllm-full-connector` | opt-in: `vllm-full`, the ctxcache connector loaded, idle | `--kv-blocks` |
| `stateless-gateway` | opt-in: `session`'s stack, whole history, no `session_id` | `--kv-blocks` |

`stateless-gateway` is what a client that never sends `session_id` gets from ctxcache (the
gateway's implicit sessions, issue 55; before them, a pass-through to vLLM). Its vLLM stores
into the same sidecar as `session`'s and its gateway shares `session`'s Redis, so its gateway
has an API key of its own tenant (`STATELESS_KEY`): the gateway salts every request per tenant
(gateway/salt.py), so the two modes share no KV block and no conversation state, although
their conversations are the same.

vLLM computes slightly differently (greedy answers can part after a few tokens) as soon as
any KV connector is configured — its own ExampleConnector gives the same answers as ours —
so `vllm-full-connector` tells that apart from anything a session changes.

`--engine builtin` runs `ctxcache serve --engine builtin` and the modes of the built-in
worker (`session`, `full`, `full-apc`, `stateless-gateway`; the in-process floor is in
`floor.py`). With `stateless-gateway` the server gets two API keys, one per tenant
(`MAIN_KEY` for the other modes, `STATELESS_KEY` for it): the same isolation as on vLLM.

Both are started with the one stack builder's parts (benchmarks/lib/stack.py).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchmarks.lib.process import Service, ctxcache_argv
from benchmarks.lib.stack import Engine, Gateway, StackBuilder, StackSettings, SupervisorRunner
from ctxcache.net import free_port
from ctxcache.supervisor import Supervisor

VLLM_BLOCK = 128  # vLLM's KV block on CPU, in tokens
STATELESS = "stateless-gateway"  # the whole history through the gateway, no session_id
VLLM_MODES = (
    "vllm-full",
    "session",
    "session-no-sidecar",
    "roomy",
    "vllm-full-connector",
    STATELESS,
)
VLLM_DEFAULT_MODES = VLLM_MODES[:4]
BUILTIN_MODES = ("session", "full", "full-apc", STATELESS)
GATEWAY_MODES = ("session", "session-no-sidecar", STATELESS)  # behind a gateway
CONNECTOR_MODES = ("session", STATELESS)  # vLLM storing into the sidecar
# the whole history with no salt of the client's: its own tenant keeps it from the session's
# KV (the gateway's per-tenant cache_salt) and from its conversations in Redis
STATELESS_KEY, STATELESS_TENANT = "bench-stateless-gateway", "bench-stateless-gateway"
MAIN_KEY, MAIN_TENANT = "bench-multiturn", "bench-multiturn"  # the builtin server's others
# the client's cache_salt of each mode on one server (`Mode.salt`)
BUILTIN_SALTS: dict[str, str | None] = {
    "session": None,
    "full": "fresh",
    "full-apc": "conversation",
    STATELESS: None,
}


@dataclass(frozen=True)
class Mode:
    """How one mode sends a turn: to `url`, the new turn with a session or the whole
    history, and which `cache_salt` (None: none; "fresh": a new one per request, so nothing
    is reused; "conversation": one per conversation)."""

    name: str
    url: str
    session: bool
    salt: str | None = None
    engine: str = ""  # the engine's own URL (its /metrics), where the benchmark started it
    api_key: str | None = None  # its bearer key (None: the run's `--api-key`)


@contextmanager
def start(
    args: argparse.Namespace, modes: list[str], model: Path, log_name: str = "servers.log"
) -> Iterator[tuple[list[Mode], Supervisor]]:
    """The modes' servers; with the event Ctrl-C sets (the supervisor owns SIGINT) and the
    supervisor (its children: `idle_cpu`)."""
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix="ctxcache-bench-") as data,
        open(Path(args.out) / log_name, "w") as log_file,  # every server's output
        Supervisor(out=log_file) as sup,
    ):
        if args.engine == "vllm":
            yield _vllm(args, modes, model, Path(data), sup), sup
        else:
            yield _builtin(args, modes, model, Path(data), sup), sup


def _builtin(
    args: argparse.Namespace, modes: list[str], model: Path, data: Path, sup: Supervisor
) -> list[Mode]:
    port = free_port()
    serve = ("serve", "--port", str(port), "--data-dir", str(data))
    argv = ctxcache_argv(*serve, "--model", str(model), "--engine", "builtin")
    keys: dict[str, str | None] = dict.fromkeys(modes)
    if STATELESS in modes:  # a tenant of its own (the module's docstring)
        argv += ["--api-key", f"{MAIN_KEY}={MAIN_TENANT}"]
        argv += ["--api-key", f"{STATELESS_KEY}={STATELESS_TENANT}"]
        keys = {m: STATELESS_KEY if m == STATELESS else MAIN_KEY for m in modes}
    env = {"CTX_WORKER_THREADS": str(args.threads)}
    SupervisorRunner(sup).start(Service("serve", argv, port, "/ready", env, 600))
    url = f"http://127.0.0.1:{port}"
    return [Mode(m, url, m == "session", BUILTIN_SALTS[m], api_key=keys[m]) for m in modes]


def _vllm(
    args: argparse.Namespace, modes: list[str], model: Path, data: Path, sup: Supervisor
) -> list[Mode]:
    needs_gateway = set(GATEWAY_MODES) & set(modes)
    stores = set(CONNECTOR_MODES) & set(modes)
    memory = ("--data-dir", str(data / "sidecar"), "--memory-bytes", str(4 << 30))
    # started together, waited for together: they compile in parallel
    threads = {"OMP_NUM_THREADS": str(args.threads)}
    engines = tuple(
        Engine("vllm", m, _vllm_args(args, m), model, m in stores, False, env=threads)
        for m in modes
    )
    settings = StackSettings(
        redis="bundled" if needs_gateway else None,
        sidecar=memory if stores else None,
        engines=engines,
    )
    builder = StackBuilder(settings, data, SupervisorRunner(sup))
    stack = builder.start()
    builder.wait_engines(timeout=900.0)
    out: list[Mode] = []
    for mode in modes:
        engine = stack.url(mode)
        if mode in needs_gateway:
            stateless = mode == STATELESS
            gateway = Gateway(
                f"gw-{mode}",
                keys={STATELESS_KEY: STATELESS_TENANT} if stateless else {},
                env=_gateway_env(args, mode),
                log_level=None,
                engines=(mode,),
                sidecar=mode in stores,
            )
            url = builder.gateway(gateway).url
            key = STATELESS_KEY if stateless else None
            out.append(Mode(mode, url, session=not stateless, engine=engine, api_key=key))
        else:
            out.append(Mode(mode, engine, session=False, engine=engine))
    return out


def _vllm_args(args: argparse.Namespace, mode: str) -> tuple[str, ...]:
    """`ctxcache vllm`'s arguments of `mode` after its model, port and sidecar."""
    argv: list[str] = []
    if mode in CONNECTOR_MODES and getattr(args, "async_loads", False):
        argv.append("--async-loads")
    if mode == "vllm-full-connector":  # loaded, never used: no request carries a tag
        argv += ["--sidecar", "lm://127.0.0.1:9"]
    if mode == "roomy":
        argv += ["--kv-cache-gib", str(args.roomy_gib)]
    else:
        argv += ["--num-blocks", str(args.kv_blocks)]
    # vLLM refuses a cache smaller than one request of max_model_len: the same window
    # for every mode, what the small cache can hold
    window = min(args.max_model_len, (args.kv_blocks - 1) * VLLM_BLOCK)  # one block: vLLM's
    argv += ["--max-model-len", str(window)]
    if getattr(args, "reserved_cpus", None) is not None:  # the same for every mode
        argv += ["--reserved-cpus", str(args.reserved_cpus)]
    argv += ["--", *args.vllm_arg]
    if _create_priority(args, mode) is not None:  # (docs/vllm.md, "Scheduling")
        argv += ["--scheduling-policy", "priority"]
    return tuple(argv)


def _create_priority(args: argparse.Namespace, mode: str) -> int | None:
    """`bench capacity --create-priority`: the session's creates get it, turns 0."""
    return getattr(args, "create_priority", None) if mode == "session" else None


def _gateway_env(args: argparse.Namespace, mode: str) -> dict[str, str]:
    priority = _create_priority(args, mode)
    return {} if priority is None else {"CTX_GATEWAY_CREATE_PRIORITY": str(priority)}


def idle_cpu(sup: Supervisor, seconds: float = 5.0) -> dict[str, float] | None:
    """Each server's CPU use while nothing is sent to it, in % of one CPU over `seconds`:
    every process of its process group (vLLM's API server, engine core and worker). This
    is what an idle engine takes from the one being measured (None where /proc is not)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    groups = {c.proc.pid: c.name for c in sup.children if c.proc is not None}

    def ticks() -> dict[str, int]:
        out = dict.fromkeys(groups.values(), 0)
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            name = groups.get(int(fields[2]))  # the process group
            if name is not None:
                out[name] += int(fields[11]) + int(fields[12])  # utime + stime
        return out

    before = ticks()
    time.sleep(seconds)
    after = ticks()
    hz = os.sysconf("SC_CLK_TCK")
    return {n: round((after[n] - before[n]) / hz / seconds * 100, 1) for n in groups.values()}
