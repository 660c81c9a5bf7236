"""Every vLLM the deployment files start can call tools: the GPU ones (compose's gpu profile,
the gpu overlays) with --enable-auto-tool-choice and a parser of the served model's family,
the CPU ones (`ctxcache vllm`) with the family's default (--tool-call-parser auto)."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

from ctxcache.cli import build_parser
from ctxcache.vllm_engine import TOOL_PARSERS, tool_parser_choice
from tests.deploy.manifests import (
    OVERLAYS,
    Container,
    compose_containers,
    flag_value,
    from_vllm_image,
    k8s_containers,
    load_compose,
    render,
)


def containers() -> list[Container]:
    found = list(compose_containers(load_compose()))
    for overlay in OVERLAYS:
        found += list(k8s_containers(render(overlay)))
    return found


def vllm_parsers() -> set[str] | None:
    """The parser names the installed vLLM registers (None: no vLLM here)."""
    if importlib.util.find_spec("vllm") is None:
        return None
    with warnings.catch_warnings():  # vLLM's imports warn about torch APIs of theirs
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm.tool_parsers import ToolParserManager

    return set(ToolParserManager.tool_parsers) | set(ToolParserManager.lazy_parsers)


def test_the_gpu_vllms_parse_tool_calls_with_their_models_parser() -> None:
    gpu = [c for c in containers() if from_vllm_image(c)]
    assert {c.where.split("/")[0] for c in gpu} == {"compose", "StatefulSet"}
    assert len(gpu) == 3  # compose's gpu profile, overlays gpu and gpu-ctxcache
    known = vllm_parsers()
    for c in gpu:
        assert "--enable-auto-tool-choice" in c.argv, c.where
        parser = flag_value(c.argv, "--tool-call-parser")
        assert parser in set(TOOL_PARSERS.values()), c.where
        assert known is None or parser in known, f"{c.where}: vLLM has no parser {parser}"
        model = flag_value(c.argv, "--model") or c.env["MODEL"]  # (the overlay's first arg)
        if model.startswith("Qwen/"):  # the shipped default model
            assert parser == "hermes", c.where


def test_the_cpu_vllms_pick_the_parser_of_the_model(tiny_model: Path) -> None:
    cpu = [c for c in containers() if c.ctxcache_command == "vllm"]
    assert cpu
    for c in cpu:
        args = build_parser().parse_args(c.argv[1:])
        assert args.tool_call_parser == "auto", c.where
        assert tool_parser_choice(args.tool_call_parser, str(tiny_model)) == "hermes"
