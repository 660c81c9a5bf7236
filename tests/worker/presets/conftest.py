"""Each new preset built once per run (the tokenizer of a size is trained once per process)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def build_preset(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`build_preset(name)`: the directory of preset `name`, built on first use."""
    from worker.presets import create_model

    built: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name not in built:
            built[name] = create_model(name, tmp_path_factory.mktemp("models") / name)
        return built[name]

    return build
