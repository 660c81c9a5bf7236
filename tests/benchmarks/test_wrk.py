"""The gateway bench's wrk glue: the Lua script it writes and the line it reads back.

(The bench run under wrk itself is in test_commands.py, where wrk is installed.)
"""

from __future__ import annotations

import pytest

from benchmarks.gateway.wrk import MARK, lua_script, parse

WRK_OUTPUT = """Running 5s test @ http://127.0.0.1:4000/v1/chat/completions
  1 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     7.20ms    6.01ms  61.90ms   95.12%
    Req/Sec     4.19k   755.39     5.07k    82.00%
  20902 requests in 5.02s, 9.73MB read
Requests/sec:   4166.23
Transfer/sec:      1.94MB
WRK_JSON {"requests": 20902, "duration_us": 5017010, "p50_us": 7041, "p99_us": 61901, \
"socket_errors": 2, "status_errors": 3}
"""


def test_parse_reads_the_done_hooks_line() -> None:
    r = parse(WRK_OUTPUT)
    assert (r.requests, r.seconds, r.p50_ms, r.p99_ms) == (20902, 5.01701, 7.041, 61.901)
    assert r.errors == 5  # socket errors and non-2xx answers alike
    assert r.requests_per_s == pytest.approx(4166.2, abs=0.1)
    with pytest.raises(ValueError, match="no WRK_JSON line"):
        parse(WRK_OUTPUT.replace(MARK, ""))


def test_the_script_carries_any_body_and_the_headers() -> None:
    body = b'{"messages": [{"content": "a]]b]=]c"}]}'
    script = lua_script(body, {"Authorization": "Bearer k"})
    assert 'wrk.method = "POST"' in script
    assert '[==[{"messages": [{"content": "a]]b]=]c"}]}]==]' in script  # no early close
    assert 'wrk.headers["Authorization"] = "Bearer k"' in script
    assert "latency:percentile(99)" in script and MARK in script
