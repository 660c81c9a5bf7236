"""Test helpers that start real processes on free ports (after vLLM's RemoteOpenAIServer), on
the one stack builder of benchmarks/lib/ (process.py, stack.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from benchmarks.lib.process import Process, ctxcache_argv
from benchmarks.lib.stack import sidecar_command
from ctxcache.net import free_port

if TYPE_CHECKING:  # (the web stack it imports is absent on a GPU box that runs the copies)
    from ctxcache.vllm_engine import VllmLaunch


class ServiceProcess(Process):
    """`ctxcache <command> ... --port <free>` as a child process, health-gated: a `Process`
    of the one stack builder's (benchmarks/lib/process.py).

    `health_path` is polled on `port` (or `health_port`) until it answers 2xx.
    Output goes to `log_path` so a failing test can show it.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        port: int | None = None,
        health_port: int | None = None,
        health_path: str = "/health",
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
        startup_timeout: float = 60.0,
        group: bool = False,
    ) -> None:
        port = port or free_port()
        command = list(command)
        if "--port" not in command:
            command += ["--port", str(port)]
        super().__init__(
            ctxcache_argv(*command),
            port=port,
            health_port=health_port,
            health_path=health_path,
            log_path=log_path,
            env=env,
            startup_timeout=startup_timeout,
            group=group,
        )


class SidecarProcess(ServiceProcess):
    """A real `ctxcache sidecar` (`sidecar_command`) with a disk tier; free ports unless
    given (to restart on the same ones); with `local_dir`, its shared-memory data path
    there too."""

    def __init__(
        self,
        data_dir: Path,
        *,
        data_port: int | None = None,
        control_port: int | None = None,
        log_path: Path | None = None,
        local_dir: Path | None = None,
    ) -> None:
        self.data_port = data_port or free_port()
        self.local_dir = local_dir  # its shared-memory directory (the local data path)
        control = control_port or free_port()
        disk = ["--data-dir", str(data_dir), "--disk-bytes", str(1 << 30)]
        # (a region for the tiny model's KV: the 4 GiB default takes seconds to reserve)
        local = ["--local-dir", str(local_dir), "--memory-bytes", str(256 << 20)]
        super().__init__(
            sidecar_command(self.data_port, control, [*disk, *(local if local_dir else [])]),
            port=control,
            log_path=log_path or data_dir / "sidecar.log",
        )

    @property
    def lm_url(self) -> str:
        return f"lm://127.0.0.1:{self.data_port}"


class VllmProcess(ServiceProcess):
    """The real vLLM OpenAI server (`ctxcache.vllm_engine.VllmLaunch`: the CPU build, our
    connector when `launch.sidecar_lm` is set). vLLM runs its engine core and workers as
    child processes, so stopping signals the whole process group."""

    def __init__(self, launch: VllmLaunch, *, log_path: Path, startup_timeout: float = 600.0):
        super().__init__(
            [],
            port=launch.port,
            log_path=log_path,
            env=launch.env(),
            startup_timeout=startup_timeout,
            group=True,
        )
        self.launch = launch
        self.command = launch.argv()


def require_vllm() -> None:
    """Skip where vLLM cannot be installed; where it can (Linux x86_64) it must be there,
    unless CTXCACHE_WITHOUT_VLLM says this machine runs without it on purpose (the GPU
    check, benchmarks/gpu_check.sh: torch with CUDA, no vLLM)."""
    import importlib.util
    import platform

    if importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get("CTXCACHE_WITHOUT_VLLM"):
        import pytest

        pytest.skip("vLLM is not installed on this machine (CTXCACHE_WITHOUT_VLLM)")
    if sys.platform == "linux" and platform.machine() == "x86_64":
        raise AssertionError("vLLM is not installed: `make test` installs ctxcache[vllm]")
    import pytest

    pytest.skip("vLLM's CPU build installs on Linux x86_64 only")


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check_png(path: Path) -> None:
    """A PNG a viewer opens: signature, an IHDR with a real size, and PIL decodes it."""
    import struct

    raw = path.read_bytes()
    assert raw[:8] == PNG_SIGNATURE
    length, kind = struct.unpack(">I4s", raw[8:16])
    width, height = struct.unpack(">II", raw[16:24])
    assert (length, kind) == (13, b"IHDR") and width > 100 and height > 100
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (width, height)
        image.load()  # decodes every pixel: a truncated file fails here
        assert image.getextrema() != ((255, 255),) * len(image.getbands())  # not blank


def metric(text: str, name: str) -> float:
    """The sum of a Prometheus exposition's samples whose name starts with `name`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def relayed_streams(http: Any, base_url: str = "") -> float:
    """How many streams without a session a gateway passed through, read from
    its `/metrics` with `http` (an httpx client or module)."""
    text = http.get(f"{base_url}/metrics").text
    name = "ctxcache_gateway_relayed_streams_total"
    assert f"\n{name} " in text, "no relayed-streams counter"
    return metric(text, name)


def shm_dir(root: Path) -> Path:
    """A fresh private directory for a sidecar's shared region: under /dev/shm (memory, as
    in production) where it is writable, else under `root`."""
    import tempfile

    base = Path("/dev/shm")
    parent = base if base.is_dir() and os.access(base, os.W_OK) else root
    return Path(tempfile.mkdtemp(prefix="ctxcache-test-", dir=parent))


@pytest.fixture(name="local_dir")
def local_dir_fixture(tmp_path: Path) -> Iterator[Path]:
    """A test's sidecar `--local-dir` (`shm_dir`), removed afterwards. A module that
    needs it imports it (not in a conftest: the GPU check runs without conftests)."""
    path = shm_dir(tmp_path)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`ctxcache ARGV...` run to its end (60 s at most), with `env` added to this one's."""
    return subprocess.run(
        [sys.executable, "-m", "ctxcache.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def run_clis(
    calls: Sequence[tuple[Sequence[str], dict[str, str] | None]],
) -> list[subprocess.CompletedProcess[str]]:
    """`run_cli` of every `(argv, env)`, all at once (a command that refuses to start costs
    its imports, a second or so; side by side they share the CPUs): the results in order."""
    with ThreadPoolExecutor(max(1, min(len(calls), 8))) as pool:
        return list(pool.map(lambda call: run_cli(*call[0], env=call[1]), calls))


def serve_hand_off(extra: list[str]) -> tuple[Any, list[str], list[str]]:
    """`ctxcache serve --model /m/tiny EXTRA --vllm-arg=--seed=1`: what it hands `ctxcache vllm`
    (parsed back), that argv, and the argv it gives the built-in worker instead."""
    from ctxcache.cli import build_parser
    from ctxcache.serve import engine_args

    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "/m/tiny", *extra, "--vllm-arg=--seed=1"])
    argv = engine_args(args, "vllm", "/m/tiny", 7003, "lm://127.0.0.1:7001", None)
    builtin = engine_args(args, "builtin", "/m/tiny", 7003, "lm://127.0.0.1:7001", None)
    return parser.parse_args(argv), argv, builtin
