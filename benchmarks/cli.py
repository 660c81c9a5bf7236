"""`ctxcache bench <name>`: one entry point for every benchmark in the repo."""

from __future__ import annotations

import argparse
import importlib

# benchmark -> module with add_arguments(parser) and main(args) -> int
BENCHMARKS: dict[str, tuple[str, str]] = {
    "manager": ("benchmarks.manager", "session operations per second vs raw redis-py"),
    "sidecar": (
        "benchmarks.sidecar.sidecar",
        "KV block PUT/GET bandwidth vs LMCache's server and Redis",
    ),
    "kvpath": (
        "benchmarks.kvpath.kvpath",
        "KV load/store through the connector, tcp vs shm vs a copy",
    ),
    "worker": ("benchmarks.worker.worker", "TTFT with cached history vs full recompute"),
    "cold-kv": (
        "benchmarks.coldkv.coldkv",
        "the sidecar's fp8 cold tiers vs plain: bytes, load time, answers' divergence",
    ),
    "gateway": ("benchmarks.gateway.gateway", "gateway overhead vs calling the worker directly"),
    "gateway-ab": ("benchmarks.gateway.gateway_ab", "streaming TTFT of two checkouts' gateways"),
    "gateway-calls": (
        "benchmarks.gateway.gateway_calls",
        "function calls per session turn in the gateway, beside another checkout",
    ),
    "gateway-keys": (
        "benchmarks.gateway.gateway_keys",
        "wrong API keys/s with 100,000 keys vs 10",
    ),
    "implicit-routing": (
        "benchmarks.gateway.implicit_routing",
        "sessionless conversations sharing a prefix, two workers: implicit sessions vs off",
    ),
    "multiturn": (
        "benchmarks.multiturn.multiturn",
        "multi-turn chat replay, session vs full history",
    ),
    "capacity": (
        "benchmarks.capacity.capacity",
        "req/s held at a p95 TTFT target, one vLLM at a time",
    ),
    "load": ("benchmarks.load.load", "concurrent sessions through the stack, then leak checks"),
    "sessions": (
        "benchmarks.sessions.sessions",
        "live sessions to 100k on one node; sidecar pin policies",
    ),
    "agents": (
        "benchmarks.agents.agents",
        "an agent's tool loop: session, stateless (vLLM, gateway), Responses",
    ),
    "reasoning": (
        "benchmarks.reasoning.reasoning",
        "a thinking model's tool-call turns: past reasoning dropped (template) vs kept",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for name, (module_name, help_text) in BENCHMARKS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(bench_main=module.main)


def main(args: argparse.Namespace) -> int:
    return int(args.bench_main(args) or 0)
