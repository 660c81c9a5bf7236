"""The presets of each kind: what each builds, that it is the same bytes twice, and that the
built-in worker refuses the kinds only vLLM runs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from transformers import AutoConfig

from tests.utils import run_cli
from tests.worker.presets.test_model import _digest
from worker.engine.runner import ModelRunner
from worker.model_cli import PRESET_NAMES
from worker.model_kind import KIND_FILE, UnsupportedModelKind, check_builtin, preset_of
from worker.presets import PRESETS, create_model

Build = Callable[[str], Path]


def test_the_cli_offers_every_preset() -> None:
    assert set(PRESET_NAMES) == set(PRESETS)


def test_tiny_sliding_alternates_windowed_and_full_layers(build_preset: Build) -> None:
    model = build_preset("tiny-sliding")
    config = AutoConfig.from_pretrained(model)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert config.sliding_window == 256  # two of vLLM's CPU blocks (128 tokens)
    tiny = PRESETS["tiny"]
    assert (config.hidden_size, config.num_key_value_heads) == (tiny.hidden_size, 2)
    assert preset_of(model) == ("tiny-sliding", "sliding")
    assert json.loads((model / KIND_FILE).read_text())["sliding_window"] == 256


def test_same_sliding_preset_same_files(build_preset: Build, tmp_path: Path) -> None:
    model = build_preset("tiny-sliding")
    assert _digest(create_model("tiny-sliding", tmp_path / "again")) == _digest(model)


def test_the_dense_presets_are_dense(tiny_model: Path) -> None:
    assert preset_of(tiny_model) == ("tiny", "dense")
    check_builtin(tiny_model)  # does not raise
    check_builtin(tiny_model.parent / "not-a-preset")


def test_the_builtin_worker_refuses_other_kinds(build_preset: Build) -> None:
    model = build_preset("tiny-sliding")
    with pytest.raises(UnsupportedModelKind, match=r"'sliding'.*--engine vllm"):
        ModelRunner(str(model))
    done = run_cli("worker", "--model", str(model), "--port", "1")
    assert done.returncode == 2
    assert "of kind 'sliding'" in done.stderr and "--engine vllm" in done.stderr
