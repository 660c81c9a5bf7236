"""`wrk` (a C HTTP/1.1 load generator, keep-alive) for the gateway bench, where installed.

A Python client costs more per request than the gateway it measures (at concurrency 32
ours reported 3-5k requests/s where wrk measures 12k): wrk takes that cost out. One wrk
thread (`-t1`, so it takes at most one of a small machine's cores) runs `connections`
keep-alive connections for `seconds`; a Lua script sets the POST body and headers and,
in wrk's `done` hook, prints one JSON line with the request count, p50 and p99. Install
it with `apt-get install wrk` (Debian/Ubuntu) or `brew install wrk`.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

MARK = "WRK_JSON "
_DONE = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '%s{"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, '
      .. '"socket_errors": %d, "status_errors": %d}\\n',
    "MARK", summary.requests, summary.duration, latency:percentile(50),
    latency:percentile(99), e.connect + e.read + e.write + e.timeout, e.status))
end
""".replace("MARK", MARK)


@dataclass
class WrkResult:
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int  # socket errors, timeouts, and answers other than 2xx/3xx

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds


def find() -> str | None:
    """The wrk executable on PATH, or None."""
    return shutil.which("wrk")


def lua_script(body: bytes, headers: dict[str, str]) -> str:
    """A wrk script that POSTs `body` with `headers` and reports as `parse` reads."""
    text = body.decode()
    level = 0
    while f"]{'=' * level}]" in text:  # a Lua long bracket the body does not close
        level += 1
    lines = ['wrk.method = "POST"', f"wrk.body = [{'=' * level}[{text}]{'=' * level}]"]
    lines.append('wrk.headers["Content-Type"] = "application/json"')
    lines += [f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in headers.items()]
    return "\n".join(lines) + "\n" + _DONE


def parse(stdout: str) -> WrkResult:
    """The result line our script's `done` hook printed."""
    line = next((x for x in stdout.splitlines() if x.startswith(MARK)), None)
    if line is None:
        raise ValueError(f"no {MARK.strip()} line in wrk's output: {stdout[-500:]!r}")
    d = json.loads(line[len(MARK) :])
    return WrkResult(
        requests=d["requests"],
        seconds=d["duration_us"] / 1e6,
        p50_ms=d["p50_us"] / 1e3,
        p99_ms=d["p99_us"] / 1e3,
        errors=d["socket_errors"] + d["status_errors"],
    )


async def run(
    wrk: str,
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    connections: int,
    seconds: float,
) -> WrkResult:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "post.lua"
        script.write_text(lua_script(body, headers))
        proc = await asyncio.create_subprocess_exec(
            *(wrk, "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s"),
            *("--timeout", "30s", "-s", str(script), url),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"wrk exited with {proc.returncode}: {err.decode()[-500:]}")
    return parse(out.decode())
