"""`ctxcache serve`: one command for the whole stack; Ctrl-C leaves nothing behind; a
restart on the same data dir continues every session."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from ctxcache.net import free_port, wait_http
from ctxcache.redis_server import RedisServer
from tests.utils import require_vllm


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (children start their own sessions, so walk ppids)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry.name)] = int(fields[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_serve(
    data: Path, port: int, log: Path, engine: str = "builtin", *extra: str
) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ctxcache.cli",
                "serve",
                "--port",
                str(port),
                "--data-dir",
                str(data),
                "--engine",
                engine,
                *extra,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        wait_http(f"http://127.0.0.1:{port}/ready", timeout=600 if engine == "vllm" else 180)
    except TimeoutError:
        proc.kill()
        raise AssertionError(log.read_text()[-3000:]) from None
    return proc


def stop_serve(proc: subprocess.Popen[bytes], bundled_redis: bool = True) -> None:
    children = descendants(proc.pid)
    # redis (unless external), sidecar, worker, gateway (and their own children)
    assert len(children) >= 3 + bundled_redis
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while any(alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in children if alive(p)], "processes left behind after Ctrl-C"


@pytest.mark.timeout(600)
def test_serve_runs_stops_cleanly_and_continues_after_restart(tmp_path: Path) -> None:
    data, port, log = tmp_path / "data", free_port(), tmp_path / "serve.log"
    base = f"http://127.0.0.1:{port}/v1"
    with openai.OpenAI(base_url=base, api_key="any", max_retries=0) as client:
        _serve_restart(client, data, port, log)


def _serve_restart(client: openai.OpenAI, data: Path, port: int, log: Path) -> None:
    proc = start_serve(data, port, log)
    try:
        banner = f"serving on http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while banner not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert banner in log.read_text()
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/context",
            json={"model": "tiny", "messages": [{"role": "system", "content": "Be brief. " * 40}]},
        )
        assert r.status_code == 200, r.text
        sid = r.json()["session_id"]
        for question in ("one?", "two?", "three?"):
            out = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": question}],
                max_tokens=4,
                temperature=0,
                extra_body={"session_id": sid},
            )
            assert out.choices[0].message.content is not None
    finally:
        stop_serve(proc)

    proc = start_serve(data, port, log)  # same data dir: Redis AOF, sidecar disk tier
    try:
        info = httpx.get(f"http://127.0.0.1:{port}/v1/context/{sid}").json()
        assert info["turns"] == 4  # the create + 3 turns survived the restart
        out = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "four?"}],
            max_tokens=4,
            temperature=0,
            extra_body={"session_id": sid},
        )
        assert (out.model_extra or {})["session"]["session_id"] == sid
        assert httpx.get(f"http://127.0.0.1:{port}/v1/context/{sid}").json()["turns"] == 5
    finally:
        stop_serve(proc)


@pytest.mark.slow  # whole-stack repeat of what make test checks piece by piece (docs/testing.md)
def test_serve_with_redis_url_keeps_sessions_in_that_redis(
    tmp_path: Path, own_redis: RedisServer
) -> None:
    """`--redis-url`: no bundled Redis is started; the sessions live in the given one."""
    data, port, log = tmp_path / "data", free_port(), tmp_path / "serve.log"
    proc = start_serve(data, port, log, "builtin", "--redis-url", own_redis.url)
    try:
        names = {Path(f"/proc/{p}/comm").read_text().strip() for p in descendants(proc.pid)}
        assert not any("redis" in n for n in names), names
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/context",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 200, r.text
        sid = r.json()["session_id"]
        client = redis.Redis(port=own_redis.port)
        try:
            assert client.hget(f"ctx:{{{sid}}}", "tenant") is not None
        finally:
            client.close()
    finally:
        stop_serve(proc, bundled_redis=False)


@pytest.mark.slow  # whole-stack repeat of what make test checks piece by piece (docs/testing.md)
def test_serve_with_a_manager_service_runs_the_sessions_through_it(tmp_path: Path) -> None:
    """`--manager-service`: the manager runs as its own process (as in compose and
    Kubernetes), the gateway reaches it over HTTP with a token of this stack's own, and a
    session's create and turn go through it (its own request counters)."""
    data, port, log = tmp_path / "data", free_port(), tmp_path / "serve.log"
    proc = start_serve(data, port, log, "builtin", "--manager-service")
    try:
        manager = f"http://127.0.0.1:{json.loads((data / 'ports.json').read_text())['manager']}"
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/context",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 200, r.text
        sid = r.json()["session_id"]
        turn = [{"role": "user", "content": "more"}]
        body = {"model": "tiny", "messages": turn, "max_tokens": 2, "session_id": sid}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        metrics = httpx.get(f"{manager}/metrics").text
        assert 'route="/sessions",status="200"' in metrics
        assert 'route="/sessions/{session_id}/append",status="200"' in metrics
        assert httpx.get(f"{manager}/sessions/{sid}").status_code == 401  # the token's
        names = {Path(f"/proc/{p}/cmdline").read_bytes() for p in descendants(proc.pid)}
        assert sum(b"manager" in n for n in names) >= 1
        assert not any(b"--token" in n for n in names)  # never on a command line
    finally:
        stop_serve(proc)


def test_ctrl_c_during_start_up_stops_cleanly(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ctxcache.cli",
                "serve",
                "--port",
                str(free_port()),
                "--data-dir",
                str(tmp_path / "data"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while "redis is up" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    children = descendants(proc.pid)
    assert children, log.read_text()
    proc.send_signal(signal.SIGINT)  # while the other services are still starting
    assert proc.wait(timeout=60) == 0, log.read_text()[-2000:]
    time.sleep(0.5)
    assert not [p for p in children | descendants(proc.pid) if alive(p)]


@pytest.mark.slow  # minutes on 2 CPUs: `make test-slow` (CI runs it)
@pytest.mark.timeout(900)
def test_a_vllm_stack_restarted_on_its_data_dir_reloads_a_session_from_the_disk_tier(
    tmp_path: Path,
) -> None:
    """`ctxcache serve --engine vllm`: after a full restart, vLLM's own prefix cache is
    empty and the sidecar's memory tier too; the session's next turn still reuses all but
    less than a block of its context, read from the sidecar's disk tier."""
    require_vllm()
    data, port, log = tmp_path / "data", free_port(), tmp_path / "serve.log"
    base = f"http://127.0.0.1:{port}"
    document = " ".join(["the cat sat on the mat and looked at the rain"] * 60)
    proc = start_serve(data, port, log, "vllm")
    try:
        assert "engine: vLLM with the ctxcache KV connector" in log.read_text()
        r = httpx.post(
            f"{base}/v1/context",
            json={"model": "tiny", "messages": [{"role": "system", "content": document}]},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        sid = r.json()["session_id"]
        first = chat_turn(base, sid, "what did the cat do?")
        assert first["usage"]["prompt_tokens"] > 512
    finally:
        stop_serve(proc)

    proc = start_serve(data, port, log, "vllm")
    try:
        info = httpx.get(f"{base}/v1/context/{sid}", timeout=30).json()
        assert info["turns"] == 2
        assert info["kv_tokens"] >= info["context_tokens"] - 128  # on the sidecar's disk
        second = chat_turn(base, sid, "and then?")
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= info["context_tokens"] - 128
    finally:
        stop_serve(proc)


def chat_turn(base: str, sid: str, question: str) -> dict[str, Any]:
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={
            "model": "tiny",
            "session_id": sid,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 8,
            "temperature": 0,
        },
        timeout=300,
    )
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_internal_ports_are_distinct_and_never_the_gateways(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing is bound when the ports are chosen, so the kernel may offer a port already
    handed out (CI once gave the sidecar's data and control ports the same number)."""
    import ctxcache.net
    from ctxcache.serve import _internal_ports

    gateway = free_port()
    offers = iter([gateway, gateway, free_port(), gateway])
    real_free_port = ctxcache.net.free_port
    monkeypatch.setattr(ctxcache.net, "free_port", lambda: next(offers, None) or real_free_port())
    ports = _internal_ports(tmp_path, reserved={gateway})
    assert len(set(ports.values())) == len(ports) and gateway not in ports.values()


def test_internal_ports_survive_a_restart_unless_a_kept_port_would_collide(
    tmp_path: Path,
) -> None:
    from ctxcache.serve import _internal_ports

    gateway = free_port()
    first = _internal_ports(tmp_path, reserved={gateway})
    assert _internal_ports(tmp_path, reserved={gateway}) == first
    # a ports.json that repeats a port, or names the gateway's, is mended on the next start
    clash = {"sidecar_data": gateway, "sidecar_control": first["engine"], "engine": first["engine"]}
    (tmp_path / "ports.json").write_text(json.dumps(clash))
    mended = _internal_ports(tmp_path, reserved={gateway})
    assert len(set(mended.values())) == len(mended) and gateway not in mended.values()
    assert mended["sidecar_control"] == first["engine"]


# ---- the shared-memory KV path: the region's directory and who is told about it --------


def serve_args(*extra: str) -> Any:
    from ctxcache.cli import build_parser

    return build_parser().parse_args(["serve", "--model", "/m/tiny", *extra])


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


@pytest.mark.parametrize("engine", ["builtin", "vllm"])
def test_the_sidecar_and_the_engine_are_given_the_same_local_dir(
    tmp_path: Path, engine: str
) -> None:
    """The sidecar makes its region and socket in the directory; the engine (either
    command) looks for them there; the region holds the memory tier plus an eighth."""
    from ctxcache.cli import build_parser
    from ctxcache.serve import engine_args, sidecar_args

    args = serve_args("--sidecar-memory-bytes", str(64 << 20), "--vllm-arg=--dtype=float32")
    local = tmp_path / "shm" / "ctxcache-x"
    sidecar = sidecar_args(args, tmp_path, 7001, 7002, local)
    worker = engine_args(args, engine, "/m/tiny", 7003, "lm://127.0.0.1:7001", local)
    assert flag(sidecar, "--local-dir") == flag(worker, "--sidecar-local-dir") == str(local)
    assert flag(sidecar, "--local-bytes") == str((64 << 20) * 9 // 8)
    parser = build_parser()  # the commands as their own CLIs read them
    assert parser.parse_args(sidecar).local_dir == str(local)
    assert parser.parse_args(worker).sidecar_local_dir == str(local)
    if engine == "vllm":  # vLLM's own arguments stay last, after `--`
        assert worker[-2:] == ["--", "--dtype=float32"]


def test_no_local_kv_gives_neither_a_local_dir(tmp_path: Path) -> None:
    from ctxcache.serve import engine_args, sidecar_args

    args = serve_args("--no-local-kv")
    assert args.no_local_kv
    argv = sidecar_args(args, tmp_path, 7001, 7002, None)
    for engine in ("builtin", "vllm"):
        argv += engine_args(args, engine, "/m/tiny", 7003, "lm://127.0.0.1:7001", None)
    assert not {"--local-dir", "--local-bytes", "--sidecar-local-dir"} & set(argv)


def test_the_region_goes_in_a_private_directory_under_dev_shm(tmp_path: Path) -> None:
    from ctxcache.serve_region import local_kv_dir, remove_local_kv_dir

    shm, data = tmp_path / "shm", tmp_path / "data"
    shm.mkdir()
    data.mkdir()
    local = local_kv_dir(data, 1 << 20, shm=shm)
    assert local is not None and local.parent == shm and local.name.startswith("ctxcache-")
    assert local.stat().st_mode & 0o777 == 0o700
    other = tmp_path / "other-data"  # a second stack beside it: a directory of its own
    other.mkdir()
    assert local_kv_dir(other, 1 << 20, shm=shm) not in {None, local}
    remove_local_kv_dir(data, shm=shm)
    assert not local.exists() and list(data.iterdir()) == []
    assert len(list(shm.iterdir())) == 1  # the other stack's, still there


def test_without_dev_shm_or_room_there_the_region_goes_under_the_data_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ctxcache.serve_region
    from ctxcache.serve_region import local_kv_dir, remove_local_kv_dir

    monkeypatch.delenv("CTX_SIDECAR_ENCRYPTION_KEY", raising=False)
    data = tmp_path / "data"
    data.mkdir()
    missing = tmp_path / "no-shm"
    local = local_kv_dir(data, 1 << 20, shm=missing)
    assert local == data / "local" and local.stat().st_mode & 0o777 == 0o700
    remove_local_kv_dir(data, shm=missing)
    assert not local.exists()
    # on disk the region would be written back in the clear: not beside an encrypted tier
    monkeypatch.setenv("CTX_SIDECAR_ENCRYPTION_KEY", "a key")
    assert local_kv_dir(data, 1 << 20, shm=missing) is None
    monkeypatch.delenv("CTX_SIDECAR_ENCRYPTION_KEY")

    shm = tmp_path / "shm"  # there, but too small for the region
    shm.mkdir()
    room = {shm: 1 << 10, data: 1 << 30}
    monkeypatch.setattr(ctxcache.serve_region, "_room", lambda path: room[path])
    assert local_kv_dir(data, 1 << 20, shm=shm) == data / "local"
    assert list(shm.iterdir()) == []
    room[data] = 1 << 10  # nowhere: KV over lm:// only, and serve still starts
    assert local_kv_dir(data, 1 << 20, shm=shm) is None
    assert not (data / "local").exists()


def test_a_killed_serves_region_is_removed_on_the_next_start(tmp_path: Path) -> None:
    """Nothing removes a region whose serve died by SIGKILL; it holds memory until the
    next start on the same data dir, which removes it (and only what serve made)."""
    from ctxcache.serve_region import local_kv_dir

    shm, data = tmp_path / "shm", tmp_path / "data"
    shm.mkdir()
    data.mkdir()
    stale = local_kv_dir(data, 1 << 20, shm=shm)
    assert stale is not None
    (stale / "kv-1.shm").write_bytes(b"\0" * 1024)
    fresh = local_kv_dir(data, 1 << 20, shm=shm)
    assert fresh is not None and fresh != stale and not stale.exists()
    # a record that names anything else is not followed
    other = shm / "someone-elses"
    other.mkdir()
    (data / "local-kv-dir").write_text(f"{other}\n")
    local_kv_dir(data, 1 << 20, shm=shm)
    assert other.is_dir()


@pytest.mark.parametrize("no_local_kv", [False, True])
def test_serve_removes_the_region_directory_when_start_up_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_local_kv: bool
) -> None:
    import ctxcache.serve
    import ctxcache.serve_region

    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(ctxcache.serve_region, "SHM", shm)
    seen: list[Path | None] = []

    def failing_run(args: Any, sup: Any, data: Path, local: Path | None) -> int:
        seen.append(local)
        assert local is None or local.is_dir()
        raise RuntimeError("sidecar exited with 1")

    monkeypatch.setattr(ctxcache.serve, "_run", failing_run)
    extra = ["--no-local-kv"] if no_local_kv else []
    args = serve_args("--data-dir", str(tmp_path / "data"), *extra)
    assert ctxcache.serve.main(args) == 1
    assert (seen[0] is None) == no_local_kv
    assert list(shm.iterdir()) == []
    assert not (tmp_path / "data" / "local-kv-dir").exists()
