"""The README's curl examples, run as written against a real stack."""

from __future__ import annotations

import httpx

from tests.ctxcache.test_readme import run_readme_curl
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
