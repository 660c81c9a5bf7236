"""The keys file (`--api-keys-file`, `CTX_GATEWAY_API_KEYS_FILE`): read at start, where a
file that cannot be used stops the command with its reason; read again on SIGHUP and when
it changes (a Kubernetes Secret volume updated in place), where a bad file keeps the keys
the gateway has; keys given as their SHA-256 digest. No message, no log line ever holds a
key (issue 39, item 9)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from gateway.auth import KeyRing
from gateway.limits import KeyPolicy, load_keys_file
from gateway.settings import GatewaySettings
from tests.utils import ServiceProcess, run_clis

SECRET = "sk-file-SECRET-0001"  # in every bad file: no message may repeat it


def digest(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def write(path: Path, content: str | bytes) -> Path:
    """Replace the file whole, as Kubernetes updates a mounted Secret (a rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(content.encode() if isinstance(content, str) else content)
    os.replace(tmp, path)
    return path


def bad_files(tmp: Path) -> dict[str, tuple[Path, str]]:
    """name -> (a path that is no usable keys file, what the refusal must say)."""
    (tmp / "a-directory").mkdir()
    fifo = tmp / "a-fifo"
    os.mkfifo(fifo)
    cases = {
        "missing": (tmp / "nowhere.json", "cannot read it (No such file or directory)"),
        "directory": (tmp / "a-directory", "cannot read it (Is a directory)"),
        "fifo": (fifo, "not a regular file"),
        "device": (Path("/dev/null"), "not a regular file"),
    }
    contents: dict[str, tuple[str | bytes, str]] = {
        "empty file": ("", "not valid JSON: Expecting value at line 1 column 1"),
        "truncated": (f'{{"{SECRET}": "acme", ', "not valid JSON"),
        "not utf-8": (f'{{"{SECRET}": "acme\xff"}}'.encode("latin-1"), "not UTF-8 text"),
        "a list": (f'["{SECRET}"]', "expected a JSON object"),
        "no key": ("{}", "names no key"),
        "a key twice": (f'{{"{SECRET}": "acme", "{SECRET}": "beta"}}', "a key is given twice"),
        "a key and its digest": (
            json.dumps({SECRET: "acme", digest(SECRET): "beta"}),
            "a key is given twice (entries 1 and 2)",
        ),
        "a bad digest": (json.dumps({"sha256:" + SECRET: "acme"}), "64 hex digits"),
        "a key with a space": (json.dumps({f"{SECRET} x": "acme"}), "has a space"),
        "a bad tenant": (json.dumps({SECRET: "acme corp"}), "entry 1: tenant: a tenant is"),
        "a limit of 0": (json.dumps({SECRET: {"tenant": "acme", "rpm": 0}}), "from 1 to"),
        "a huge limit": (json.dumps({SECRET: "acme:tpm=" + "9" * 40}), "from 1 to"),
        "a number too long": (f'{{"{SECRET}": {{"rpm": {"9" * 5000}}}}}', "number too long"),
        "an unknown field": (json.dumps({SECRET: {"tenant": "a", "burst": 1}}), "Extra inputs"),
        "a field twice": (
            f'{{"{SECRET}": {{"tenant": "a", "tenant": "b"}}}}',
            "a field of the object is given twice",
        ),
        "too large": ("{" + " " * (16 * 2**20) + "}", "larger than"),
    }
    for n, (name, (content, reason)) in enumerate(contents.items()):
        cases[name] = (write(tmp / f"bad-{n}.json", content), reason)
    return cases


def test_a_file_that_cannot_be_used_is_refused_with_its_reason(tmp_path: Path) -> None:
    for name, (path, reason) in bad_files(tmp_path).items():
        with pytest.raises(ValueError) as exc:
            load_keys_file(path)
        message = str(exc.value)
        assert message.startswith(f"keys file {str(path)!r}: ") and reason in message, name
        assert "SECRET" not in message, name


def test_an_unreadable_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "keys.json", json.dumps({SECRET: "acme"}))
    path.chmod(0)
    if os.access(path, os.R_OK):  # root reads it anyway: refuse the open as the kernel would
        real_open = os.open

        def no_access(file: object, *args: object, **kw: object) -> int:
            if Path(str(file)) == path:
                raise PermissionError(13, "Permission denied", str(file))
            return real_open(file, *args, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "open", no_access)
    with pytest.raises(ValueError, match=r"cannot read it \(Permission denied\)"):
        load_keys_file(path)


def test_a_good_file_gives_keys_limits_and_digests(tmp_path: Path) -> None:
    doc = {
        "sk-plain": "acme:rpm=5",
        digest("sk-hidden"): {"tenant": "beta", "tpm": 1000},
        "c2stc2VjcmV0==": "gamma",
    }
    path = write(tmp_path / "keys.json", "\ufeff" + json.dumps(doc, indent=2))  # (a BOM)
    keys = load_keys_file(path)
    assert keys == {
        "sk-plain": KeyPolicy(tenant="acme", rpm=5),
        digest("sk-hidden"): KeyPolicy(tenant="beta", tpm=1000),
        "c2stc2VjcmV0==": KeyPolicy(tenant="gamma"),
    }
    ring = KeyRing(keys)
    assert ring.key_for("Bearer sk-hidden").tpm == 1000
    assert ring.tenant_for("Bearer c2stc2VjcmV0==") == "gamma"
    # settings read it, so settings naming a file never make an open gateway
    assert GatewaySettings(api_keys_file=path).api_keys == keys
    assert GatewaySettings(api_keys_file="").api_keys_file is None  # an empty variable: unset


def test_settings_refuse_keys_given_two_ways_and_a_bad_file(tmp_path: Path) -> None:
    path = write(tmp_path / "keys.json", json.dumps({"sk-a": "acme"}))
    with pytest.raises(ValidationError, match="give them one way"):
        GatewaySettings(api_keys_file=path, api_keys={"sk-b": "beta"})
    with pytest.raises(ValidationError, match="cannot read it"):
        GatewaySettings(api_keys_file=tmp_path / "nowhere.json")


async def test_a_ring_reload_keeps_its_keys_when_the_file_is_bad(tmp_path: Path) -> None:
    path = write(tmp_path / "keys.json", json.dumps({"sk-a": "acme"}))
    ring = KeyRing(load_keys_file(path))
    (tmp_path / "bad").mkdir()
    for name, (bad, _) in bad_files(tmp_path / "bad").items():
        assert not await ring.reload(bad), name
        assert ring.tenant_for("Bearer sk-a") == "acme"
    write(path, json.dumps({digest("sk-b"): "beta:rpm=3"}))
    assert await ring.reload(path)
    assert ring.tenant_for("Bearer sk-b") == "beta" and ring.limited


def test_gateway_and_serve_refuse_to_start_on_a_bad_file(tmp_path: Path) -> None:
    cases = bad_files(tmp_path)
    calls: list[tuple[list[str], dict[str, str], str]] = []
    for name in ("missing", "truncated", "a key twice", "no key"):
        path, reason = cases[name]
        for argv, env in (
            (["gateway", "--api-keys-file", str(path)], {}),
            (["gateway"], {"CTX_GATEWAY_API_KEYS_FILE": str(path)}),
            (["serve", "--api-keys-file", str(path), "--data-dir", str(tmp_path / name)], {}),
        ):
            calls.append(([*argv, "--port", "1"], env, reason))
    good = write(tmp_path / "keys.json", json.dumps({SECRET: "acme"}))
    calls.append(
        (["serve", "--api-keys-file", str(good), "--api-key", f"{SECRET}=acme"], {}, "one way")
    )
    calls.append(
        (
            ["gateway", "--api-keys-file", str(good)],
            {"CTX_GATEWAY_API_KEYS": '{"sk-b": "b"}'},
            "give them one way",
        )
    )
    done_all = run_clis([(argv, env) for argv, env, _ in calls])
    for done, (argv, _, reason) in zip(done_all, calls, strict=True):
        assert done.returncode == 1 and reason in done.stderr, (argv, done.stderr)
        assert "SECRET" not in done.stderr + done.stdout
    assert "give the keys one way" in done_all[-2].stderr


def until(check: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.timeout(120)
def test_sighup_reloads_the_keys_file_and_a_bad_file_keeps_the_keys(
    tmp_path: Path, redis_url: str
) -> None:
    key_a, key_b = "sk-reload-AAAA-1111", "sk-reload-BBBB-2222"
    keys = write(tmp_path / "keys.json", json.dumps({key_a: "tenant-k"}))
    log = tmp_path / "gateway.log"
    gateway = ServiceProcess(
        ["gateway", "--redis-url", redis_url, "--api-keys-file", str(keys)],
        log_path=log,
        env={"CTX_GATEWAY_API_KEYS_FILE_POLL_S": "0"},  # SIGHUP alone reloads here
    ).start()
    try:
        assert gateway.proc is not None
        url = f"{gateway.url}/v1/context"

        def status(key: str) -> int:
            return httpx.get(url, headers={"authorization": f"Bearer {key}"}).status_code

        def hangup_until_logged(text: str) -> None:
            seen = log.read_text().count(text)
            assert gateway.proc is not None
            gateway.proc.send_signal(signal.SIGHUP)
            until(lambda: log.read_text().count(text) > seen, f"{text!r} in the log")

        assert (status(key_a), status(key_b)) == (200, 401)
        write(keys, json.dumps({digest(key_b): "tenant-k"}))  # B, as its digest only
        hangup_until_logged("API keys reloaded")
        assert (status(key_a), status(key_b)) == (401, 200)
        assert status(digest(key_b)) == 401  # the digest is no password

        for bad in (f'{{"{SECRET}": "tenant-k", ', f'{{"{SECRET}": "a", "{SECRET}": "b"}}'):
            write(keys, bad)
            hangup_until_logged("API keys NOT reloaded")
            assert (status(key_a), status(key_b), status(SECRET)) == (401, 200, 401)
        keys.unlink()
        hangup_until_logged("API keys NOT reloaded")
        assert (status(key_a), status(key_b)) == (401, 200)
        assert gateway.proc.poll() is None  # SIGHUP never ends it

        text = log.read_text()
        assert "cannot read it (No such file or directory)" in text
        assert "a key is given twice" in text and "not valid JSON" in text
        for key in (key_a, key_b, SECRET):
            assert key not in text and key[-9:] not in text
        cmdline = Path(f"/proc/{gateway.proc.pid}/cmdline").read_bytes()
        assert key_a.encode() not in cmdline and str(keys).encode() in cmdline
    finally:
        gateway.stop()


def secret_volume(root: Path, content: str) -> Path:
    """A Kubernetes Secret volume: `api-keys.json` -> `..data/api-keys.json`, `..data` -> a
    timestamped directory; an update writes a new directory and swaps `..data` (a rename),
    so the file's path never changes and no process is told."""
    root.mkdir(exist_ok=True)
    update = root / f"..{time.monotonic_ns()}"
    update.mkdir()
    (update / "api-keys.json").write_text(content)
    link = root / "..data_tmp"
    link.symlink_to(update.name)
    os.replace(link, root / "..data")
    keys = root / "api-keys.json"
    if not keys.is_symlink():
        keys.symlink_to("..data/api-keys.json")
    return keys


async def test_a_secret_updated_in_place_is_read_again_without_a_signal(
    tmp_path: Path, redis_url: str
) -> None:
    from asgi_lifespan import LifespanManager

    from gateway.app import create_app

    volume = tmp_path / "secret"
    keys = secret_volume(volume, json.dumps({"sk-old": "acme"}))
    settings = GatewaySettings(redis_url=redis_url, api_keys_file=keys, api_keys_file_poll_s=0.05)  # type: ignore[call-arg]
    app = create_app(settings)
    async with LifespanManager(app) as running:
        transport = httpx.ASGITransport(app=running.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:

            async def status(key: str) -> int:
                r = await http.get("/v1/context", headers={"authorization": f"Bearer {key}"})
                return r.status_code

            async def until(want: tuple[int, int]) -> None:
                deadline = time.monotonic() + 10
                while (await status("sk-old"), await status("sk-new")) != want:
                    assert time.monotonic() < deadline, f"keys not reloaded: want {want}"
                    await asyncio.sleep(0.05)

            assert (await status("sk-old"), await status("sk-new")) == (200, 401)
            secret_volume(volume, json.dumps({digest("sk-new"): "acme"}))  # the update
            await until((401, 200))
            secret_volume(volume, '{"sk-old": ')  # a bad update keeps the keys
            await asyncio.sleep(0.3)
            assert (await status("sk-old"), await status("sk-new")) == (401, 200)
            secret_volume(volume, json.dumps({"sk-old": "acme"}))  # and a good one after it
            await until((200, 401))
