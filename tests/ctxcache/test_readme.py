"""The README stays true: its configuration table and its curl examples."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from ctxcache import config_table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_config_table_matches_the_settings_classes() -> None:
    text = README.read_text()
    assert config_table.update(text) == text, (
        "README configuration table is stale: run `python -m ctxcache.config_table --write "
        "README.md`"
    )


def curl_script() -> str:
    text = README.read_text()
    block = text.split("<!-- readme-curl:begin -->", 1)[1].split("<!-- readme-curl:end -->")[0]
    match = re.search(r"```bash\n(.*?)```", block, re.S)
    assert match, "no bash block between the readme-curl markers"
    return match.group(1)


def sdk_example() -> str:
    """The README's first `openai` SDK example (the Responses API)."""
    text = README.read_text()
    block = text.split("<!-- readme-sdk:begin -->", 1)[1].split("<!-- readme-sdk:end -->")[0]
    match = re.search(r"```python\n(.*?)```", block, re.S)
    assert match, "no python block between the readme-sdk markers"
    return match.group(1)


def run_readme_curl(base_url: str, key: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BASE": base_url, "KEY": key}
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", curl_script()],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
