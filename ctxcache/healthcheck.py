"""The image's HEALTHCHECK: `GET /health` of whichever service this container runs.

    python -m ctxcache.healthcheck [COMMAND LINE...]

The command line defaults to the container's main process (PID 1: `ctxcache <command> ...`
under the image's entrypoint, or vLLM's server once `ctxcache vllm` has replaced itself
with it). The port is the one that service listens on: its flag, else its `CTX_<SERVICE>_*`
variable, else its default; the sidecar answers on its control port. A container that runs
no server (`model create`, `--help`) has nothing to check and is healthy.
`HEALTHCHECK_URL`, where set, is checked instead. Exit 0: healthy; 1: not.
"""

from __future__ import annotations

import os
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path

# service -> (the flag and the CTX_ variable of its health port, the default port)
HEALTH_PORTS: dict[str, tuple[str, str, int]] = {
    "gateway": ("--port", "CTX_GATEWAY_PORT", 8000),
    "serve": ("--port", "CTX_GATEWAY_PORT", 8000),
    "manager": ("--port", "CTX_MANAGER_PORT", 8300),
    "sidecar": ("--control-port", "CTX_SIDECAR_CONTROL_PORT", 8200),
    "worker": ("--port", "CTX_WORKER_PORT", 8100),
    "vllm": ("--port", "", 8100),
}
VLLM_SERVER = "vllm.entrypoints.openai.api_server"


def main_process_argv() -> list[str]:
    return Path("/proc/1/cmdline").read_bytes().decode().split("\0")[:-1]


def flag(argv: Sequence[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def health_url(argv: Sequence[str], env: dict[str, str]) -> str | None:
    """The health URL of the service `argv` runs; None where it runs no server."""
    if env.get("HEALTHCHECK_URL"):
        return env["HEALTHCHECK_URL"]
    if VLLM_SERVER in argv:
        service, rest = "vllm", list(argv)  # vLLM's own server, after `ctxcache vllm` exec'd it
    else:
        at = next((i for i, a in enumerate(argv) if Path(a).name == "ctxcache"), None)
        if at is None or at + 1 >= len(argv):
            return None
        service, rest = argv[at + 1], list(argv[at + 2 :])
    if service not in HEALTH_PORTS:
        return None
    name, variable, default = HEALTH_PORTS[service]
    port = flag(rest, name) or (env.get(variable) if variable else None) or default
    return f"http://127.0.0.1:{int(port)}/health"


def main(argv: Sequence[str] | None = None) -> int:
    url = health_url(list(argv) if argv else main_process_argv(), dict(os.environ))
    if url is None:
        return 0
    try:
        with urllib.request.urlopen(url, timeout=4) as response:
            return 0 if response.status == 200 else 1
    except OSError as exc:
        sys.stderr.write(f"{url}: {exc}\n")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
