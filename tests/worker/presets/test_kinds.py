"""The presets of each kind: what each builds, that it is the same bytes twice, and that the
built-in worker refuses the kinds only vLLM runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoConfig

from tests.utils import require_vllm, run_cli
from tests.worker.presets.test_model import _digest
from tests.worker.presets.vllm_kv_groups import MARK
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


def vllm_kv_groups(model: Path) -> dict[str, Any]:
    """What vLLM builds of `model`'s KV cache (`vllm_kv_groups.py`, in a child process)."""
    require_vllm()
    done = subprocess.run(
        [sys.executable, "-m", "tests.worker.presets.vllm_kv_groups", str(model)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1][len(MARK) :])


def test_vllm_builds_a_sliding_and_a_full_kv_group(build_preset: Build) -> None:
    found = vllm_kv_groups(build_preset("tiny-sliding"))
    assert found["architecture"] == "LlamaForCausalLM" and found["block_size"] == 128
    kinds = [(g["spec"]["type"], g["spec"]["sliding_window"]) for g in found["groups"]["hma_on"]]
    assert sorted(kinds, key=str) == [("FullAttentionSpec", None), ("SlidingWindowSpec", 256)]
    layers = {g["spec"]["type"]: g["layers"] for g in found["groups"]["hma_on"]}
    assert [int(n.split(".")[2]) for n in layers["SlidingWindowSpec"]] == [0, 2]
    assert [int(n.split(".")[2]) for n in layers["FullAttentionSpec"]] == [1, 3]
    # without the hybrid manager (a connector that is not SupportsHMA) every layer keeps
    # full-size KV in one group
    (one,) = found["groups"]["hma_off"]
    assert one["spec"]["type"] == "FullAttentionSpec" and len(one["layers"]) == 4


def test_tiny_mla_is_deepseek_v3_latent_attention(build_preset: Build) -> None:
    model = build_preset("tiny-mla")
    config = AutoConfig.from_pretrained(model)
    assert config.architectures == ["DeepseekV3ForCausalLM"]
    assert (config.kv_lora_rank, config.qk_rope_head_dim, config.q_lora_rank) == (512, 64, None)
    assert config.first_k_dense_replace == config.num_hidden_layers  # no expert layer
    assert preset_of(model) == ("tiny-mla", "mla")


def test_vllm_builds_one_latent_kv_group_on_16_token_blocks(build_preset: Build) -> None:
    found = vllm_kv_groups(build_preset("tiny-mla"))
    assert found["architecture"] == "DeepseekV3ForCausalLM" and found["backends"] == ["CPU_MLA"]
    (group,) = found["groups"]["hma_on"]
    spec = group["spec"]
    assert (spec["type"], spec["head_size"], spec["num_kv_heads"]) == ("MLAAttentionSpec", 576, 1)
    assert spec["block_size"] == 16 == found["block_size"]  # the CPU MLA kernel's only size
    assert len(group["layers"]) == 4
