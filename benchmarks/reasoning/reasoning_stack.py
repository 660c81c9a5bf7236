"""The stack `ctxcache bench reasoning` starts: Redis, the sidecar, one vLLM with the
ctxcache connector and its reasoning and tool parsers, and one gateway in front of it with
an API key per session mode (a tenant each: the gateway's per-tenant `cache_salt` keeps
their KV apart). `stateless` calls that vLLM directly, without a salt."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.lib.stack import Engine, Gateway, StackBuilder, StackSettings, SupervisorRunner
from benchmarks.multiturn.multiturn_stacks import VLLM_BLOCK
from benchmarks.reasoning.reasoning import REFERENCE
from ctxcache.supervisor import Supervisor

# each session mode's API key, of a tenant of its own
KEYS = {"session-template": "bench-reasoning-template", "session-keep": "bench-reasoning-keep"}
GATEWAY_PARSER_ENV = "CTX_GATEWAY_REASONING_PARSER"


@dataclass
class ReasoningStack:
    """The started stack: the gateway's and vLLM's URLs, the reasoning parser asked for
    (None: the defaults) and vLLM's /metrics read (`kvpath_vllm.scrape`)."""

    gateway: str
    engine: str
    reasoning_parser: str | None
    metrics: Callable[[], dict[str, float]] = field(default=lambda: {})


@contextmanager
def start(args: argparse.Namespace, model: Path) -> Iterator[tuple[ReasoningStack, Supervisor]]:
    """The stack, every server's output in `OUT/servers.log`; with the supervisor (its
    `stopping` event: Ctrl-C)."""
    import httpx

    from benchmarks.kvpath.kvpath_vllm import scrape

    Path(args.out).mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix="ctxcache-bench-") as data,
        open(Path(args.out) / "servers.log", "w") as log_file,
        Supervisor(out=log_file) as sup,
    ):
        memory = ("--data-dir", str(Path(data) / "sidecar"), "--memory-bytes", str(4 << 30))
        engine = Engine(
            "vllm",
            "vllm",
            vllm_args(args),
            model,
            store=True,
            wait=False,
            env={"OMP_NUM_THREADS": str(args.threads)},
        )
        settings = StackSettings(redis="bundled", sidecar=memory, engines=(engine,))
        builder = StackBuilder(settings, Path(data), SupervisorRunner(sup))
        stack = builder.start()
        builder.wait_engines(timeout=900.0)
        parser = args.reasoning_parser or default_parser(model)
        env = {GATEWAY_PARSER_ENV: parser} if parser else {}
        gateway = Gateway("gateway", keys={k: k for k in KEYS.values()}, env=env, log_level=None)
        url = builder.gateway(gateway).url
        with httpx.Client(base_url=stack.url("vllm"), timeout=30) as vllm:
            yield ReasoningStack(url, stack.url("vllm"), parser, lambda: scrape(vllm)), sup


def default_parser(model: Path) -> str | None:
    """The reasoning parser `ctxcache vllm` picks for `model` by default (the gateway is
    told the same one)."""
    from ctxcache.vllm_reasoning import default_reasoning_parser

    return default_reasoning_parser(str(model))


def vllm_args(args: argparse.Namespace) -> tuple[str, ...]:
    """`ctxcache vllm`'s arguments after its model, port and sidecar."""
    window = min(args.max_model_len, (args.kv_blocks - 1) * VLLM_BLOCK)  # (vLLM's check)
    argv = ["--num-blocks", str(args.kv_blocks), "--max-model-len", str(window)]
    argv += ["--dtype", args.dtype]
    if args.reasoning_parser:  # (else `ctxcache vllm`'s default for the model)
        argv += ["--reasoning-parser", args.reasoning_parser]
    return (*argv, "--", *args.vllm_arg)


@contextmanager
def clients(stack: ReasoningStack, modes: list[str]) -> Iterator[dict[str, Any]]:
    """An httpx client per mode (closed when the block ends): the session modes' to the
    gateway with their key, `stateless`'s to vLLM (always: the session modes' references)."""
    import httpx

    with ExitStack() as opened:
        out: dict[str, Any] = {}
        for mode in dict.fromkeys([*modes, REFERENCE]):
            headers = {"content-type": "application/json"}
            url = stack.engine
            if mode != REFERENCE:
                headers["authorization"] = f"Bearer {KEYS[mode]}"
                url = stack.gateway
            client = httpx.Client(base_url=url, headers=headers, timeout=900)
            out[mode] = opened.enter_context(client)
        yield out
