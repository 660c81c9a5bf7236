"""vLLM starts with a tool parser for the model's family (`--tool-call-parser auto`), one
named, or none: `ctxcache vllm` and `ctxcache serve --engine vllm` alike."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from ctxcache.vllm_engine import VllmLaunch, default_tool_parser
from tests.utils import serve_hand_off


def model_dir(tmp_path: Path, name: str, **config: object) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    "config, parser",
    [
        ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, "hermes"),
        ({"model_type": "qwen2_moe"}, "hermes"),
        ({"model_type": "qwen3"}, "hermes"),
        ({"model_type": "qwen3_moe"}, "hermes"),
        ({"model_type": "llama", "vocab_size": 128256}, "llama3_json"),
        ({"model_type": "mistral"}, "mistral"),
        ({"model_type": "mixtral"}, "mistral"),
        ({"model_type": "gpt_oss"}, "openai"),
        ({"architectures": ["Qwen3ForCausalLM"]}, "hermes"),  # no model_type
        ({"architectures": ["MixtralForCausalLM"]}, "mistral"),
    ],
)
def test_the_default_parser_follows_the_family(tmp_path: Path, config: dict, parser: str) -> None:
    assert default_tool_parser(model_dir(tmp_path, "m", **config)) == parser


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]},
        {"model_type": "llama", "vocab_size": 32000},  # Llama 2: no tool-call format
        {},
    ],
)
def test_a_family_without_a_default_has_tools_off_and_says_how_to_pick(
    tmp_path: Path, config: dict, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="ctxcache.vllm_engine"):
        assert default_tool_parser(model_dir(tmp_path, "m", **config)) is None
    assert "tool calling off" in caplog.text and "--tool-call-parser" in caplog.text


def test_a_hub_id_or_a_broken_config_has_no_default(tmp_path: Path) -> None:
    assert default_tool_parser("Qwen/Qwen2.5-0.5B-Instruct") is None
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert default_tool_parser(str(broken)) is None


def test_the_presets_are_qwen2_so_hermes(tiny_model: Path) -> None:
    assert default_tool_parser(str(tiny_model)) == "hermes"


def test_the_parser_reaches_vllms_command_line() -> None:
    argv = VllmLaunch("m", "m", 8100, tool_call_parser="hermes").argv()
    at = argv.index("--tool-call-parser")
    assert argv[at + 1] == "hermes" and "--enable-auto-tool-choice" in argv
    bare = VllmLaunch("m", "m", 8100).argv()
    assert "--tool-call-parser" not in bare and "--enable-auto-tool-choice" not in bare


def launched_parser(monkeypatch: pytest.MonkeyPatch, *line: str) -> str | None:
    """The --tool-call-parser `ctxcache vllm <line>` hands vLLM (None: tools off)."""
    import ctxcache.vllm_engine as vllm_engine
    from ctxcache.cli import build_parser

    launched: list[list[str]] = []
    monkeypatch.setattr(vllm_engine, "available", lambda: True)
    monkeypatch.setattr(os, "execvpe", lambda _file, argv, _env: launched.append(list(argv)))
    vllm_engine.main(build_parser().parse_args(["vllm", *line, "--", "--enforce-eager"]))
    (argv,) = launched
    if "--tool-call-parser" not in argv:
        assert "--enable-auto-tool-choice" not in argv
        return None
    assert "--enable-auto-tool-choice" in argv
    return argv[argv.index("--tool-call-parser") + 1]


def test_ctxcache_vllm_picks_names_or_drops_the_parser(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    qwen = model_dir(tmp_path, "qwen", model_type="qwen2")
    assert launched_parser(monkeypatch, "--model", qwen) == "hermes"  # auto, the default
    assert launched_parser(monkeypatch, "--model", qwen, "--tool-call-parser", "auto") == "hermes"
    assert launched_parser(monkeypatch, "--model", qwen, "--tool-call-parser", "none") is None
    named = launched_parser(monkeypatch, "--model", qwen, "--tool-call-parser", "qwen3_xml")
    assert named == "qwen3_xml"
    gpt2 = model_dir(tmp_path, "gpt2", model_type="gpt2")
    assert launched_parser(monkeypatch, "--model", gpt2) is None
    assert launched_parser(monkeypatch, "--model", "org/hub-model") is None


@pytest.mark.parametrize("choice", [None, "none", "mistral"])
def test_serve_hands_its_choice_to_ctxcache_vllm(choice: str | None) -> None:
    handed, argv, builtin = serve_hand_off([] if choice is None else ["--tool-call-parser", choice])
    assert handed.tool_call_parser == (choice or "auto")
    assert argv[-2:] == ["--", "--seed=1"]  # vLLM's own arguments stay last
    assert "--tool-call-parser" not in builtin
