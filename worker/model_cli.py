"""`ctxcache model create --preset NAME DIR` (the presets: worker/presets/spec.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

# Spelled out so that `--help` does not import torch; a test keeps it equal to `PRESETS`.
PRESET_NAMES = (
    "tiny",
    "small",
    "tiny-sliding",
    "small-sliding",
    "tiny-mla",
    "tiny-hybrid",
    "tiny-gemma3",
    "tiny-think",
    "small-think",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    create = sub.add_parser("create", help="build a deterministic random-weight model + tokenizer")
    create.add_argument("--preset", choices=PRESET_NAMES, default="tiny")
    create.add_argument("dir", type=Path, help="output directory (a Hugging Face model dir)")


def main(args: argparse.Namespace) -> int:
    from ctxcache.logs import setup_logging
    from worker.presets import create_model

    setup_logging("model")
    create_model(args.preset, args.dir)
    return 0
