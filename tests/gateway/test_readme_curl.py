"""The README's curl and SDK examples, run as written against a real stack."""

from __future__ import annotations

import httpx
import pytest

from tests.ctxcache.test_readme import run_readme_curl, sdk_example
from tests.gateway.conftest import Stack


def test_readme_curl_examples_run(stack: Stack) -> None:
    done = run_readme_curl(stack.url, "key-a")
    assert done.returncode == 0, done.stderr + done.stdout
    out = done.stdout
    sid = out.split("session: ", 1)[1].split()[0]
    assert sid.startswith("ctx_")
    assert '"object":"chat.completion"' in out and '"cached_tokens"' in out
    assert '"ttl":7200' in out
    assert '"object":"context.deleted"' in out
    r = httpx.get(f"{stack.url}/v1/context/{sid}", headers={"authorization": "Bearer key-a"})
    assert r.status_code == 404  # step 5 really deleted it


def test_readme_sdk_example_runs(stack: Stack, capsys: pytest.CaptureFixture[str]) -> None:
    code = sdk_example()
    assert "previous_response_id" in code  # the Responses example comes first
    code = code.replace("http://127.0.0.1:8000/v1", f"{stack.url}/v1")
    exec(compile(code.replace('"sk-local"', '"key-a"'), "README.md", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    cached = [int(line.rsplit(" ", 1)[1]) for line in lines[:2]]
    assert cached[1] > 0  # the second turn reused the first one's KV
    assert lines[2] == "['system', 'user', 'assistant']"
