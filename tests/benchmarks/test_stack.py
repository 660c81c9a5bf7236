"""The one stack builder (benchmarks/lib/stack.py) run the tests' way: every process a
`Process` with its own log (`ProcessRunner`), a turn through the gateway it started, and
nothing left running once it is stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.lib.process import Process, Service
from benchmarks.lib.stack import (
    Engine,
    Gateway,
    ProcessRunner,
    StackBuilder,
    StackSettings,
    engine_service,
    route,
)
from ctxcache.net import free_port


def test_a_stack_of_the_tests_answers_through_its_gateway_and_stops_whole(tmp_path: Path) -> None:
    settings = StackSettings(
        redis_appendonly=False,
        sidecar=("--memory-bytes", str(64 << 20)),
        engines=(Engine("fake", "worker", store=True, route="w0"),),
        gateway=Gateway(keys={"stack-key": "tenant-s"}, env={"CTX_GATEWAY_MIN_TTL": "1"}),
    )
    runner = ProcessRunner(tmp_path)
    try:
        with StackBuilder(settings, tmp_path, runner).started() as stack:
            assert set(stack.pids) == {"redis", "sidecar", "worker", "gateway"}
            assert stack.sidecar_lm is not None and stack.sidecar_lm.startswith("lm://")
            body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}
            headers = {"authorization": "Bearer stack-key"}
            r = httpx.post(
                f"{stack.gateway}/v1/chat/completions", json=body, headers=headers, timeout=30
            )
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"]
            r = httpx.post(f"{stack.gateway}/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 401  # the key it was given is the only one
            procs = list(runner.procs.values())
            assert all(p.proc is not None and p.proc.poll() is None for p in procs)
            assert (tmp_path / "gateway.log").exists() and (tmp_path / "worker.log").exists()
    finally:
        runner.stop()
    assert all(p.proc is None for p in procs)
    assert runner.procs == {}


def test_a_gateway_route_names_the_worker_and_its_sidecar() -> None:
    assert route("http://127.0.0.1:1") == "http://127.0.0.1:1"
    assert route("http://w:1", "http://s:2", "w0") == "w0@http://w:1=http://s:2"


def test_a_process_that_exits_while_starting_fails_at_once_with_its_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('no config here'); sys.exit(3)"]
    proc = Process(argv, port=free_port(), log_path=tmp_path / "p.log", startup_timeout=60)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="no config here"):
        proc.start()
    assert time.monotonic() - t0 < 30  # not its whole startup_timeout
    assert proc.proc is None


def test_a_process_started_without_a_check_is_waited_for_later_and_signalled(
    tmp_path: Path,
) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    web = Service("web", [*argv, "--directory", str(tmp_path)], port, None)
    proc = web.process(tmp_path / "web.log").start()  # spawned: nothing says when it is up
    try:
        proc.until_ready("/")
        assert httpx.get(f"{proc.url}/", timeout=10).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.proc is not None and proc.proc.wait(timeout=10) == -signal.SIGTERM
    finally:
        proc.stop()


def test_vllm_is_stopped_with_its_children_as_a_process_group(tmp_path: Path) -> None:
    vllm = Engine("vllm", "vllm", command=("vllm",), port=1)
    assert engine_service(vllm, 1, None).group
    assert not engine_service(Engine("builtin", "worker"), 1, None).group
    marker = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"open({str(marker)!r}, 'w').write(str(c.pid)); time.sleep(120)"
    )
    service = Service("parent", [sys.executable, "-c", code], free_port(), None, group=True)
    proc = service.process(tmp_path / "parent.log").start()
    try:
        deadline = time.monotonic() + 30
        while not marker.exists() or not marker.read_text():
            assert time.monotonic() < deadline, "no child started"
            time.sleep(0.05)
        child = int(marker.read_text())
    finally:
        proc.stop()
    stat = Path(f"/proc/{child}/stat")
    deadline = time.monotonic() + 10
    while stat.exists() and stat.read_text().split(") ")[-1][0] != "Z":
        assert time.monotonic() < deadline, "the child outlived its group's stop"
        time.sleep(0.05)


def test_a_process_dies_with_the_benchmark_that_started_it(tmp_path: Path) -> None:
    """A benchmark killed (SIGKILL: no cleanup runs) leaves no sidecar or engine behind:
    each `Process` asks the kernel for SIGKILL when its parent dies."""
    pid_file = tmp_path / "child.pid"
    parent = (
        "import sys, time\n"
        "from benchmarks.lib.process import Process\n"
        "p = Process(('sleep', '300'), port=0).spawn()\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.proc.pid))\n"
        "time.sleep(300)\n"
    )
    bench = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the parent did not start its child"
            time.sleep(0.05)
        child = int(pid_file.read_text())
        bench.kill()
        bench.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child):
            assert time.monotonic() < deadline, "the child outlived its SIGKILLed parent"
            time.sleep(0.05)
    finally:
        if bench.poll() is None:
            bench.kill()
        if pid_file.exists() and pid_file.read_text() and _alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)  # (ours: the test failed)


def _alive(pid: int) -> bool:
    """Running (a zombie of init's is gone for our purpose)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"
