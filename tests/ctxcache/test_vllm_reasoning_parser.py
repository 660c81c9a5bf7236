"""vLLM starts with a reasoning parser where the model thinks (`--reasoning-parser auto`), one
named, or none; the thinking preset with its script. `ctxcache vllm` and `ctxcache serve
--engine vllm` alike, and serve tells the gateway which parser its engine runs."""

from __future__ import annotations

import json
import logging
import os
import warnings
from pathlib import Path

import pytest

from ctxcache.vllm_engine import VllmLaunch
from ctxcache.vllm_reasoning import (
    REASONING_PARSERS,
    default_reasoning_parser,
    preset_logits_processors,
    reasoning_parser_choice,
)
from tests.utils import serve_hand_off

THINKS = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
PLAIN = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
# DeepSeek-V3.1's shape: a `thinking` switch
SWITCH = "{% if thinking %}{{ '<think>' }}{% else %}{{ '</think>' }}{% endif %}"


def model_dir(tmp_path: Path, name: str, template: str | None = None, **config: object) -> str:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    if template is not None:
        (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return str(path)


@pytest.mark.parametrize(
    "config, parser",
    [
        ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, "qwen3"),
        ({"model_type": "qwen3_moe"}, "qwen3"),
        ({"model_type": "qwen3_next"}, "qwen3"),
        ({"model_type": "deepseek_v3"}, "deepseek_r1"),
        ({"model_type": "glm4_moe"}, "glm45"),
        ({"model_type": "kimi_k2"}, "kimi_k2"),
        ({"architectures": ["Qwen3MoeForCausalLM"]}, "qwen3"),  # no model_type
    ],
)
def test_a_thinking_checkpoint_gets_its_familys_parser(
    tmp_path: Path, config: dict, parser: str
) -> None:
    assert default_reasoning_parser(model_dir(tmp_path, "m", THINKS, **config)) == parser


def test_the_same_family_without_thinking_gets_none(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Qwen3-Instruct-2507, DeepSeek-V3-0324, Kimi-K2-Instruct: their templates write no
    `<think>`; Qwen3's parser would file their answers as reasoning."""
    for family in ("qwen3", "deepseek_v3", "kimi_k2"):
        with caplog.at_level(logging.INFO, logger="ctxcache.vllm_reasoning"):
            model = model_dir(tmp_path, family, PLAIN, model_type=family)
            assert default_reasoning_parser(model) is None
        assert "reasoning parser off" in caplog.text and "--reasoning-parser" in caplog.text


def test_gpt_oss_always_thinks_and_a_thinking_switch_picks_deepseek_v3(tmp_path: Path) -> None:
    assert default_reasoning_parser(model_dir(tmp_path, "oss", model_type="gpt_oss")) == (
        "openai_gptoss"
    )
    v31 = model_dir(tmp_path, "v31", SWITCH, model_type="deepseek_v3")
    assert default_reasoning_parser(v31) == "deepseek_v3"


def test_the_template_is_read_from_chat_template_jinja_too(tmp_path: Path) -> None:
    model = model_dir(tmp_path, "q", model_type="qwen3")
    assert default_reasoning_parser(model) is None
    (Path(model) / "chat_template.jinja").write_text(THINKS)
    assert default_reasoning_parser(model) == "qwen3"


@pytest.mark.parametrize(
    "config", [{"model_type": "qwen2"}, {"model_type": "llama"}, {"model_type": "gpt2"}, {}]
)
def test_a_family_without_thinking_has_none(tmp_path: Path, config: dict) -> None:
    assert default_reasoning_parser(model_dir(tmp_path, "m", THINKS, **config)) is None


def test_a_hub_id_or_a_broken_config_has_none(tmp_path: Path) -> None:
    assert default_reasoning_parser("Qwen/Qwen3-8B") is None
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert default_reasoning_parser(str(broken)) is None


def test_every_default_is_a_parser_of_the_installed_vllm() -> None:
    pytest.importorskip("vllm")
    with warnings.catch_warnings():  # vLLM's imports warn about torch APIs of theirs
        warnings.simplefilter("ignore", DeprecationWarning)
        from vllm.reasoning import ReasoningParserManager

    known = set(ReasoningParserManager.reasoning_parsers) | set(ReasoningParserManager.lazy_parsers)
    assert set(REASONING_PARSERS.values()) | {"deepseek_v3"} <= known


def test_only_the_thinking_preset_has_a_parser_and_a_script(
    tiny_model: Path, think_model: Path
) -> None:
    assert default_reasoning_parser(str(tiny_model)) is None
    assert preset_logits_processors(str(tiny_model)) == []
    assert default_reasoning_parser(str(think_model)) == "qwen3"
    assert preset_logits_processors(str(think_model)) == ["worker.presets.think_script:ThinkScript"]


def test_the_parser_and_the_script_reach_vllms_command_line() -> None:
    script = "worker.presets.think_script:ThinkScript"
    argv = VllmLaunch("m", "m", 8100, reasoning_parser="qwen3", logits_processors=[script]).argv()
    assert argv[argv.index("--reasoning-parser") + 1] == "qwen3"
    assert argv[argv.index("--logits-processors") + 1] == script
    bare = VllmLaunch("m", "m", 8100).argv()
    assert "--reasoning-parser" not in bare and "--logits-processors" not in bare


def launched(monkeypatch: pytest.MonkeyPatch, *line: str) -> list[str]:
    """The argv `ctxcache vllm <line>` hands vLLM."""
    import ctxcache.vllm_engine as vllm_engine
    from ctxcache.cli import build_parser

    argvs: list[list[str]] = []
    monkeypatch.setattr(vllm_engine, "available", lambda: True)
    monkeypatch.setattr(os, "execvpe", lambda _file, argv, _env: argvs.append(list(argv)))
    vllm_engine.main(build_parser().parse_args(["vllm", *line, "--", "--enforce-eager"]))
    (argv,) = argvs
    return argv


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_ctxcache_vllm_picks_names_or_drops_the_parser(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, think_model: Path, tiny_model: Path
) -> None:
    qwen3 = model_dir(tmp_path, "qwen3", THINKS, model_type="qwen3")
    assert flag(launched(monkeypatch, "--model", qwen3), "--reasoning-parser") == "qwen3"
    none = launched(monkeypatch, "--model", qwen3, "--reasoning-parser", "none")
    assert flag(none, "--reasoning-parser") is None
    named = launched(monkeypatch, "--model", qwen3, "--reasoning-parser", "deepseek_r1")
    assert flag(named, "--reasoning-parser") == "deepseek_r1"
    assert flag(launched(monkeypatch, "--model", "org/hub"), "--reasoning-parser") is None
    # the presets: the thinking one with its parser and its script, the others with neither
    think = launched(monkeypatch, "--model", str(think_model))
    assert flag(think, "--reasoning-parser") == "qwen3"
    assert flag(think, "--logits-processors") == "worker.presets.think_script:ThinkScript"
    assert flag(think, "--tool-call-parser") == "hermes"  # Qwen3: Hermes tool calls
    plain = launched(monkeypatch, "--model", str(tiny_model))
    assert "--reasoning-parser" not in plain and "--logits-processors" not in plain
    # a script is the preset's, whatever parser is named: the model still thinks
    off = launched(monkeypatch, "--model", str(think_model), "--reasoning-parser", "none")
    assert flag(off, "--reasoning-parser") is None and "--logits-processors" in off


@pytest.mark.parametrize("choice", [None, "none", "qwen3"])
def test_serve_hands_its_choice_to_ctxcache_vllm(choice: str | None) -> None:
    handed, argv, builtin = serve_hand_off([] if choice is None else ["--reasoning-parser", choice])
    assert handed.reasoning_parser == (choice or "auto")
    assert argv[-2:] == ["--", "--seed=1"]  # vLLM's own arguments stay last
    assert "--reasoning-parser" not in builtin


def test_serve_tells_the_gateway_the_parser_its_vllm_runs(
    tiny_model: Path, think_model: Path
) -> None:
    from ctxcache.cli import build_parser
    from ctxcache.serve import reasoning_env

    def env(engine: str, model: Path, *extra: str) -> dict[str, str]:
        args = build_parser().parse_args(["serve", "--model", str(model), *extra])
        return reasoning_env(args, engine, str(model))

    assert env("vllm", think_model) == {"CTX_GATEWAY_REASONING_PARSER": "qwen3"}
    assert env("vllm", think_model, "--reasoning-parser", "none") == {}
    assert env("vllm", tiny_model) == {}
    named = env("vllm", tiny_model, "--reasoning-parser", "deepseek_r1")
    assert named == {"CTX_GATEWAY_REASONING_PARSER": "deepseek_r1"}
    assert env("builtin", think_model) == {}  # the built-in worker parses no reasoning
    assert reasoning_parser_choice("none", str(think_model)) is None
