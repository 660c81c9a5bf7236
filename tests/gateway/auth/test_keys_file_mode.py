"""A keys file that every user can write is refused, as sshd refuses such key files: the
gateway (and `ctxcache serve`) will not start on it, and a reload leaves the keys as they
were and logs why. A group-writable one is read with a warning (docs/limits.md, "Who may
write the keys file"; issue 48)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from pathlib import Path

import httpx
import pytest
from asgi_lifespan import LifespanManager

from gateway.app import create_app
from gateway.limits import load_keys_file
from gateway.settings import GatewaySettings
from tests.utils import run_cli

SECRET = "sk-mode-SECRET-0001"


def octal(mode: int) -> str:
    return f"{mode:04o}"


def write(path: Path, keys: dict[str, str], mode: int = 0o600) -> Path:
    """Replace the file whole (a rename), in `mode` whatever the umask."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(keys))
    tmp.chmod(mode)
    os.replace(tmp, path)
    return path


@pytest.mark.parametrize("mode", [0o666, 0o622, 0o602, 0o777, 0o646], ids=octal)
def test_a_file_every_user_can_write_is_refused(
    tmp_path: Path, mode: int, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path / "keys.json", {SECRET: "acme"}, mode)
    with pytest.raises(ValueError) as exc:
        load_keys_file(path)
    assert str(exc.value).startswith(
        f"keys file {str(path)!r}: every user can write it (mode {mode:04o}); refused"
    )
    assert "chmod go-w" in str(exc.value) and SECRET not in str(exc.value)


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o640, 0o440, 0o644, 0o444], ids=octal)
def test_a_file_only_its_owner_can_write_is_read_without_a_word(
    tmp_path: Path, mode: int, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path / "keys.json", {SECRET: "acme"}, mode)
    assert list(load_keys_file(path)) == [SECRET]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("mode", [0o660, 0o664, 0o620], ids=octal)
def test_a_group_writable_file_is_read_with_a_warning(
    tmp_path: Path, mode: int, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path / "keys.json", {SECRET: "acme"}, mode)
    assert list(load_keys_file(path)) == [SECRET]
    (warning,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    message = warning.getMessage()
    assert str(path) in message and f"group {path.stat().st_gid} can write it" in message
    assert f"(mode {mode:04o})" in message and "chmod g-w" in message


def test_gateway_and_serve_refuse_to_start_on_a_file_every_user_can_write(
    tmp_path: Path, redis_url: str
) -> None:
    keys = write(tmp_path / "keys.json", {SECRET: "acme"}, 0o666)
    reason = f"keys file {str(keys)!r}: every user can write it (mode 0666)"
    with socket.socket() as taken:  # (so that a gateway that did start would stop at once)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for argv, env in (
            (["gateway", "--redis-url", redis_url, "--api-keys-file", str(keys)], {}),
            (["gateway", "--redis-url", redis_url], {"CTX_GATEWAY_API_KEYS_FILE": str(keys)}),
            (["serve", "--api-keys-file", str(keys), "--data-dir", str(tmp_path / "d")], {}),
        ):
            done = run_cli(*argv, "--port", port, env=env)
            assert done.returncode == 1 and reason in done.stderr, (argv, done.stderr)
            assert SECRET not in done.stderr + done.stdout
    assert not (tmp_path / "d").exists()  # serve stopped before it started anything


async def test_a_reload_refuses_a_file_every_user_can_write_and_keeps_the_keys(
    tmp_path: Path, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gateway")
    keys = write(tmp_path / "keys.json", {"sk-old": "acme"})
    settings = GatewaySettings(redis_url=redis_url, api_keys_file=keys, api_keys_file_poll_s=0.05)  # type: ignore[call-arg]
    app = create_app(settings)
    async with LifespanManager(app) as running:
        transport = httpx.ASGITransport(app=running.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:

            async def statuses() -> tuple[int, int]:
                got = []
                for key in ("sk-old", "sk-new"):
                    r = await http.get("/v1/context", headers={"authorization": f"Bearer {key}"})
                    got.append(r.status_code)
                return got[0], got[1]

            async def logged(text: str) -> None:
                deadline = time.monotonic() + 10
                while not any(text in r.getMessage() for r in caplog.records):
                    assert time.monotonic() < deadline, f"{text!r} not logged"
                    await asyncio.sleep(0.05)

            assert await statuses() == (200, 401)
            write(keys, {"sk-new": "acme"}, 0o666)  # a change anyone could have made
            await logged("API keys NOT reloaded")
            assert await statuses() == (200, 401)
            (refusal,) = [r for r in caplog.records if "NOT reloaded" in r.getMessage()]
            assert refusal.levelno == logging.ERROR
            assert f"{str(keys)!r}: every user can write it (mode 0666)" in refusal.getMessage()

            keys.chmod(0o600)  # the owner takes it back: the watch sees the mode change
            await logged("API keys reloaded")
            assert await statuses() == (401, 200)
