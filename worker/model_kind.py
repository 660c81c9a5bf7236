"""Which kind of preset a model directory holds, and the built-in worker's refusal of the
kinds it does not run. Reads one JSON file; imports neither torch nor transformers."""

from __future__ import annotations

import json
from pathlib import Path

# Written by `ctxcache model create` into each directory it builds.
KIND_FILE = "ctxcache_preset.json"
BUILTIN_KINDS = frozenset({"dense"})


class UnsupportedModelKind(ValueError):
    """The built-in worker was given a preset of a kind only vLLM runs."""


def preset_of(model_dir: Path | str) -> tuple[str, str] | None:
    """`(preset, kind)` of a directory `ctxcache model create` built (`dense` for presets
    built before kinds were recorded), or None for any other model."""
    try:
        row = json.loads((Path(model_dir) / KIND_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(row, dict):
        return None
    return str(row.get("preset", "?")), str(row.get("kind", "dense"))


def check_builtin(model_dir: Path | str) -> None:
    """Raise `UnsupportedModelKind` if the built-in worker cannot run this model."""
    found = preset_of(model_dir)
    if found is None or found[1] in BUILTIN_KINDS:
        return
    preset, kind = found
    raise UnsupportedModelKind(
        f"model {model_dir} is the {preset!r} preset, of kind {kind!r}: the built-in worker "
        f"runs only the dense (Qwen2) presets; serve this one with --engine vllm"
    )
