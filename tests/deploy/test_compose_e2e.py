"""The documented container stack, for real: build the image, `docker compose --profile cpu
up --wait`, use it as the README does, restart the KV sidecar and the worker, `down -v`.

Runs wherever a Docker daemon and compose v2 answer (`make test-compose` runs it alone) and
skips with the reason elsewhere. It builds with what the environment says
(`DOCKER_BUILDKIT`, the `CTXCACHE_*` build settings of docker-compose.yml: base images,
package indexes, an extra CA bundle; docs/deploy.md), under a compose project of its own
(`COMPOSE_PROJECT_NAME`, default `ctxcache-e2e`), so it never touches a `ctxcache` stack
that is running. The gateway is published on `CTXCACHE_PORT` if set, else 8000 if free,
else a free port.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.ctxcache.test_readme import run_readme_curl, sdk_example
from tests.deploy.manifests import ROOT

log = logging.getLogger(__name__)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

KEY = "sk-local"  # the key of docker-compose.yml's default keys file
BUILD_TIMEOUT_S = 3600.0
UP_TIMEOUT_S = 900.0
# a system prompt of about 2,600 tokens of the tiny model: ten 256-token chunks
DOCUMENT = " ".join(
    f"Section {i}: the cache keeps the token history in Redis and the KV in the sidecar."
    for i in range(90)
)


def docker_unavailable() -> str | None:
    """Why this machine cannot run the stack, or None when it can."""
    if shutil.which("docker") is None:
        return "no docker CLI on PATH"
    try:
        info = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            text=True,
            timeout=15,
        )
    except subprocess.TimeoutExpired:
        return "no Docker daemon reachable (`docker info` did not answer in 15 s)"
    if info.returncode != 0:
        reason = (info.stderr.strip().splitlines() or ["no output"])[-1]
        return f"no Docker daemon reachable (`docker info`: {reason})"
    try:
        compose = subprocess.run(
            ["docker", "compose", "version", "--short"],
            capture_output=True,
            text=True,
            timeout=15,
        )
    except subprocess.TimeoutExpired:
        return "`docker compose version` did not answer in 15 s"
    if compose.returncode != 0 or not compose.stdout.strip().lstrip("v").startswith("2"):
        return "no Docker Compose v2 (`docker compose version` failed; install the plugin)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@dataclass
class ComposeStack:
    """The cpu profile of docker-compose.yml, under a project name of its own."""

    project: str
    port: int
    env: dict[str, str]
    image: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def compose(self, *args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        argv = ["docker", "compose", "--profile", "cpu", *args]
        done = subprocess.run(
            argv, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if done.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-4000:]}"
                f"\n{done.stderr[-4000:]}\n{self.logs()}"
            )
        return done

    def logs(self, service: str = "") -> str:
        argv = ["docker", "compose", "--profile", "cpu", "logs", "--no-color", "--tail", "60"]
        done = subprocess.run(
            [*argv, *([service] if service else [])],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return done.stdout + done.stderr

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service).stdout.strip()

    def wait_healthy(self, service: str, timeout: float) -> float:
        """Seconds until the service's container reports healthy again."""
        start = time.monotonic()
        cid = self.container(service)
        status = ""
        while time.monotonic() - start < timeout:
            status = subprocess.run(
                ["docker", "inspect", "--format", "{{.State.Health.Status}}", cid],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
            if status == "healthy":
                return time.monotonic() - start
            time.sleep(1.0)
        raise AssertionError(f"{service} is {status!r} after {timeout:.0f} s\n{self.logs(service)}")

    def restart(self, service: str) -> float:
        start = time.monotonic()
        self.compose("restart", service)
        self.wait_healthy(service, timeout=UP_TIMEOUT_S)
        elapsed = time.monotonic() - start
        log.info("restart %s: healthy again after %.1f s", service, elapsed)
        return elapsed


@pytest.fixture(scope="module")
def stack() -> Iterator[ComposeStack]:
    reason = docker_unavailable()
    if reason:
        pytest.skip(reason)
    port = int(os.environ.get("CTXCACHE_PORT") or (8000 if port_is_free(8000) else free_port()))
    env = {
        **os.environ,
        "COMPOSE_PROJECT_NAME": os.environ.get("COMPOSE_PROJECT_NAME", "ctxcache-e2e"),
        "CTXCACHE_PORT": str(port),
        "CTXCACHE_API_KEYS_FILE": str(ROOT / "deploy" / "api-keys.dev.json"),
    }
    image = env.get("CTXCACHE_IMAGE", "ctxcache:0.1.0")
    stack = ComposeStack(project=env["COMPOSE_PROJECT_NAME"], port=port, env=env, image=image)
    start = time.monotonic()
    stack.compose("build", timeout=BUILD_TIMEOUT_S)
    built = time.monotonic()
    size = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Size}}", image],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout.strip()
    log.info("build: %.1f s, image %s: %s bytes", built - start, image, size)
    try:
        stack.compose("up", "--detach", "--wait", timeout=UP_TIMEOUT_S)
        log.info("up --wait: healthy after %.1f s", time.monotonic() - built)
        yield stack
    finally:
        stack.compose("down", "--volumes", "--timeout", "30")


def turn(stack: ComposeStack, sid: str, text: str, deadline_s: float = 120.0) -> dict[str, object]:
    """One chat turn of a session; a 503 while a restarted worker rejoins is retried."""
    end = time.monotonic() + deadline_s
    while True:
        r = httpx.post(
            f"{stack.url}/v1/chat/completions",
            headers={"authorization": f"Bearer {KEY}"},
            json={
                "model": "tiny",
                "session_id": sid,
                "max_tokens": 16,
                "messages": [{"role": "user", "content": text}],
            },
            timeout=120.0,
        )
        if r.status_code != 503 or time.monotonic() > end:
            assert r.status_code == 200, r.text
            return dict(r.json())
        time.sleep(1.0)


def cached_tokens(answer: dict[str, object]) -> int:
    usage = answer["usage"]
    assert isinstance(usage, dict)
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def test_readme_curl_walk_through_runs_against_the_containers(stack: ComposeStack) -> None:
    done = run_readme_curl(stack.url, KEY)
    assert done.returncode == 0, done.stderr + done.stdout
    out = done.stdout
    sid = out.split("session: ", 1)[1].split()[0]
    assert sid.startswith("ctx_")
    assert '"object":"chat.completion"' in out and '"cached_tokens"' in out
    assert '"ttl":7200' in out and '"object":"context.deleted"' in out
    r = httpx.get(f"{stack.url}/v1/context/{sid}", headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 404  # step 5 really deleted it


def test_readme_sdk_responses_example_runs_against_the_containers(
    stack: ComposeStack, capsys: pytest.CaptureFixture[str]
) -> None:
    code = sdk_example()
    assert "previous_response_id" in code
    code = code.replace("http://127.0.0.1:8000/v1", f"{stack.url}/v1")
    names: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), names)
    # The model's random text may hold newlines: read the answers, not the printed lines.
    # These turns are shorter than one of vLLM's CPU cache blocks, so `cached_tokens` may be
    # 0 here; the long session below shows the reuse.
    second = names["r"]  # the loop's last response, which continued from the first
    assert second.previous_response_id is not None  # type: ignore[attr-defined]
    assert second.usage.input_tokens > 0  # type: ignore[attr-defined]
    assert names["fork"].previous_response_id == second.previous_response_id  # type: ignore[attr-defined]
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "['system', 'user', 'assistant']"


def test_a_session_keeps_its_kv_through_sidecar_and_worker_restarts(
    stack: ComposeStack,
) -> None:
    headers = {"authorization": f"Bearer {KEY}"}
    created = httpx.post(
        f"{stack.url}/v1/context",
        headers=headers,
        json={"model": "tiny", "messages": [{"role": "system", "content": DOCUMENT}]},
        timeout=120.0,
    )
    assert created.status_code == 200, created.text
    sid = created.json()["session_id"]
    first = turn(stack, sid, "What does the cache keep?")
    assert cached_tokens(first) > 0, first["usage"]  # the long context's KV was reused
    turns = httpx.get(f"{stack.url}/v1/context/{sid}", headers=headers).json()["turns"]

    # The sidecar writes its memory tier to its volume on SIGTERM and reloads it at start.
    stack.restart("sidecar")
    reloaded = re.findall(r"disk tier: (\d+) blocks", stack.logs("sidecar"))
    assert reloaded and int(reloaded[-1]) > 0, stack.logs("sidecar")

    # A restarted vLLM has an empty prefix cache: what it reuses now comes from the sidecar.
    stack.restart("worker")
    after = turn(stack, sid, "And after the restarts?")
    assert cached_tokens(after) > 0, after["usage"]
    usage = after["usage"]
    assert isinstance(usage, dict)
    info = httpx.get(f"{stack.url}/v1/context/{sid}", headers=headers).json()
    assert info["turns"] == turns + 1  # the history is whole and the turn appended
    # ... and it came through the shared-memory volume, not the socket (the cpu profile
    # mounts one tmpfs in the sidecar and the engine: docs/deploy.md)
    if stack.env.get("CTXCACHE_ENGINE", "vllm") == "vllm":  # (the connector's counters)
        shm = engine_counter(stack, "load_bytes_shm")
        tcp = engine_counter(stack, "load_bytes_tcp")
        assert shm > 0 and tcp == 0, (shm, tcp)
    log.info(
        "session %s: %s of %s prompt tokens cached after the restarts",
        sid,
        cached_tokens(after),
        usage["prompt_tokens"],
    )


def engine_counter(stack: ComposeStack, name: str) -> float:
    """A `vllm:ctxcache_<name>_total` counter of the engine, read inside its container."""
    read = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8100/metrics').read().decode())"
    text = stack.compose("exec", "-T", "worker", "python", "-c", read).stdout
    found = re.findall(rf"^vllm:ctxcache_{name}_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
    return sum(float(v) for v in found)


def test_the_image_healthcheck_finds_each_service(stack: ComposeStack) -> None:
    """Compose names each probe itself; the image's own HEALTHCHECK (for `docker run`) must
    find the service of every container too."""
    for service in ("manager", "sidecar", "worker", "gateway"):
        done = subprocess.run(
            ["docker", "exec", stack.container(service), "python", "-m", "ctxcache.healthcheck"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, (service, done.stderr)
    config = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{json .Config.Healthcheck}}", stack.image],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert json.loads(config.stdout)["Test"] == ["CMD", "python", "-m", "ctxcache.healthcheck"]


def test_the_reasoning_parser_setting_reaches_vllm_and_the_gateway(stack: ComposeStack) -> None:
    """CTXCACHE_REASONING_PARSER is vLLM's --reasoning-parser and the gateway's parser: by
    default empty, which means none in both (not a parser named ""), so the gateway refuses
    a request that asks for thinking rather than return it inside `content`."""
    parser = stack.env.get("CTXCACHE_REASONING_PARSER", "")
    if stack.env.get("CTXCACHE_ENGINE", "vllm") == "vllm":
        read = "import json; print(json.dumps(open('/proc/1/cmdline').read().split(chr(0))))"
        out = stack.compose("exec", "-T", "worker", "python", "-c", read).stdout
        argv = [str(a) for a in json.loads(out)]  # vLLM's server: `ctxcache vllm` exec'd it
        assert "vllm.entrypoints.openai.api_server" in " ".join(argv), argv
        given = argv[argv.index("--reasoning-parser") + 1] if "--reasoning-parser" in argv else ""
        assert given == parser, argv
    if parser:
        return  # (a thinking model's turn is beyond the tiny preset)
    r = httpx.post(
        f"{stack.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY}"},
        json={
            "model": "tiny",
            "max_tokens": 4,
            "reasoning_effort": "high",
            "messages": [{"role": "user", "content": "Think first."}],
        },
        timeout=60.0,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "reasoning_effort", r.text


def test_a_cli_without_a_daemon_is_a_reason_to_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CI machine has the docker CLI and no daemon: that must skip, not fail or hang."""
    if shutil.which("docker") is None:
        assert docker_unavailable() == "no docker CLI on PATH"
        return
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    reason = docker_unavailable()
    assert reason is not None and reason.startswith("no Docker daemon reachable"), reason
