"""The real vLLM (CPU build, the tiny preset) with the ctxcache connector, behind the gateway:
one server for the module, a real sidecar, the run's Redis; started by the one
`StackBuilder` (benchmarks/lib/stack.py) with the tests' `ProcessRunner`."""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest

from benchmarks.lib.process import Process
from benchmarks.lib.stack import Engine, Gateway, StackSettings, manager_service
from ctxcache.cpu import vllm_dtype
from ctxcache.lmcache_keys import session_key
from ctxcache.net import free_port
from ctxcache.redis_server import RedisServer
from ctxcache.vllm_engine import VllmLaunch
from ctxcache.vllm_reasoning import preset_logits_processors
from tests.stacks import started
from tests.utils import require_vllm, shm_dir

WORDS = "the cat sat on a mat while dogs ran over green hills and people talked of rain".split()  # noqa: SIM905


def document(seed: int, words: int = 700) -> str:
    """A system prompt of `words` random words (about 1,250 tokens of the tiny model at 700)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


VLLM_TIMEOUT = 900  # per test: the module's vLLM takes ~1 minute to start on 2 cores


@dataclass
class VllmStack:
    root: Path
    sidecar: Process
    vllm: Process
    gateway: Process
    http: httpx.Client  # to the gateway, closed with the stack
    manager: Process | None = None  # the manager service, when the stack has one
    sidecar_lm: str = ""  # the sidecar's lm:// URL

    @property
    def url(self) -> str:
        return self.gateway.url

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's own prefix cache (VLLM_SERVER_DEV_MODE): what is reused after this
        came from the sidecar."""
        httpx.post(f"{self.vllm.url}/reset_prefix_cache", timeout=60).raise_for_status()

    def held(self, session_id: str) -> dict[str, int]:
        """What the sidecar holds for a session (its control API)."""
        key = session_key(session_id)
        return httpx.get(f"{self.sidecar.url}/sessions/{key}", timeout=10).json()

    def restart_sidecar(self) -> None:
        """Stop the sidecar and start it again: same ports, data dir and shared memory."""
        self.sidecar.stop()
        self.sidecar.start()


@pytest.fixture(scope="session")
def vllm_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, tiny_model: Path
) -> Iterator[VllmStack]:
    """The default stack, shared by every module that needs no other configuration: a vLLM
    start is a minute or two on 2 CPUs. Its tests leave it as they found it (a sidecar they
    restart is restarted; sessions are their own; counters are read as deltas)."""
    with started_stack(tmp_path_factory, redis_server, tiny_model) as stack:
        yield stack


@pytest.fixture(scope="session")
def think_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer, think_model: Path
) -> Iterator[VllmStack]:
    """The thinking preset (`tiny-think`, served as `tiny-think`) with vLLM's `qwen3`
    reasoning parser and the preset's think script, the gateway told the parser
    (CTX_GATEWAY_REASONING_PARSER), shared like `vllm_stack`: its tests leave it as they
    found it. Eager (nothing compiled): it starts in a fraction of the time on a loaded
    machine. float32: the session answers of `test_reasoning_vllm.py` are compared with this
    engine's answers to the whole conversation, token for token."""
    with started_stack(
        tmp_path_factory,
        redis_server,
        think_model,
        served_name="tiny-think",
        dtype="float32",
        reasoning_parser="qwen3",
        vllm_args=("--enforce-eager",),
    ) as stack:
        yield stack


@contextmanager
def started_stack(
    tmp_path_factory: pytest.TempPathFactory,
    redis_server: RedisServer,
    tiny_model: Path,
    connector_config: dict[str, object] | None = None,
    *,
    local: bool = True,
    manager: bool = False,
    served_name: str = "tiny",
    dtype: str | None = None,
    vllm_args: tuple[str, ...] = (),
    reasoning_parser: str | None = None,
) -> Iterator[VllmStack]:
    """vLLM with the connector (`connector_config`: its extra settings), a sidecar and a
    gateway, stopped when the block ends. `local`: KV moves through the sidecar's shared
    memory (as `ctxcache serve` sets it up), else over lm:// only. `manager`: the gateway
    reaches Redis through a manager service (which pins the sessions' KV), else through
    the manager in its own process. `tiny_model` may be any preset, served as
    `served_name`; `dtype`: vLLM's --dtype (default: as `ctxcache serve` picks it for this
    CPU); `vllm_args`: vLLM's own flags besides (`--dtype` among them wins over `dtype`).
    `reasoning_parser`: vLLM's --reasoning-parser, and the gateway's
    CTX_GATEWAY_REASONING_PARSER (None: neither). A preset's logits processors (the
    thinking preset's think script) are loaded as `ctxcache vllm` loads them.
    Every process inherits this one's environment."""
    require_vllm()
    root = tmp_path_factory.mktemp("vllm-stack")
    local_dir = shm_dir(root) if local else None
    sidecar = ["--data-dir", str(root / "sidecar"), "--disk-bytes", str(1 << 30)]
    if local_dir is not None:
        # (a region for the tiny model's KV: the 4 GiB default takes seconds to reserve)
        sidecar += ["--local-dir", str(local_dir), "--memory-bytes", str(256 << 20)]
    settings = StackSettings(redis=redis_server.url, sidecar=tuple(sidecar))
    try:
        with started(settings, root) as (builder, runner):
            stack = builder.stack
            assert stack.sidecar_lm is not None
            launch = VllmLaunch(
                model=str(tiny_model),
                served_name=served_name,
                port=free_port(),
                sidecar_lm=stack.sidecar_lm,
                sidecar_local_dir=str(local_dir) if local_dir else None,
                kv_cache_gib=1,
                dev_mode=True,
                connector_config=dict(connector_config or {}),
                tool_call_parser="hermes",  # as `ctxcache serve` picks for the presets (Qwen2)
                reasoning_parser=reasoning_parser,
                logits_processors=preset_logits_processors(str(tiny_model)),
                # as `ctxcache serve` picks for this CPU: bfloat16 with AMX or avx512_bf16,
                # else float32; full and session answers come from this one engine, in one dtype
                dtype=dtype or vllm_dtype().dtype,
                extra_args=list(vllm_args),
            )
            vllm = Engine("vllm", "vllm", env=launch.env(), startup_timeout=600)
            builder.add_engine(replace(vllm, command=tuple(launch.argv()), port=launch.port))
            # The manager's and gateway's ports are picked only now: picked before vLLM's
            # minute of start-up, one was once taken meanwhile by a port vLLM bound (CI)
            store = ["--redis-url", redis_server.url]
            env = {"CTX_GATEWAY_HEALTH_INTERVAL_S": "0.5"}
            if reasoning_parser:
                env["CTX_GATEWAY_REASONING_PARSER"] = reasoning_parser
            if manager:
                token = "manager-token-vllm-stack"
                builder.add(manager_service(redis_server.url, token))
                store = ["--manager-url", stack.url("manager")]
                env["CTX_GATEWAY_MANAGER_TOKEN"] = token
            builder.gateway(Gateway(env=env, log_level=None, timeout=60.0), store)
            procs = runner.procs
            with httpx.Client(base_url=stack.gateway, timeout=300) as http:
                yield VllmStack(
                    root,
                    procs["sidecar"],
                    procs["vllm"],
                    procs["gateway"],
                    http,
                    procs.get("manager"),
                    stack.sidecar_lm,
                )
    finally:
        if local_dir is not None:
            shutil.rmtree(local_dir, ignore_errors=True)
