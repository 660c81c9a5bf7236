"""The `ctxcache` command: one entry point, one subcommand per service.

Each subcommand lives next to the code it runs, in a module with two functions:
`add_arguments(parser)` and `main(args) -> int`. Those modules keep heavy imports
(torch, transformers) inside `main`, so `ctxcache --help` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module, one-line help). SPEC.md's CLI table is the contract for these.
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("ctxcache.serve", "run the whole stack on this machine with a bundled Redis"),
    "gateway": ("gateway.cli", "run the OpenAI-compatible gateway"),
    "manager": ("cache_manager.cli", "run the Context Cache Manager (sessions in Redis)"),
    "sidecar": ("sidecar.cli", "run the KV sidecar (LMCache lm:// protocol)"),
    "worker": ("worker.cli", "run the built-in CPU inference worker"),
    "vllm": ("ctxcache.vllm_engine", "run vLLM with the ctxcache KV connector"),
    "model": ("worker.model_cli", "build local models for offline runs and tests"),
    "bench": ("benchmarks.cli", "run a benchmark"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ctxcache", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            continue  # that service has not landed yet
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(handler=module.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
