"""Where the deployed gateways get their API keys: a file mounted from the Secret (k8s) or
a compose secret, named by CTX_GATEWAY_API_KEYS_FILE — never a command line (every user of
the node reads it) nor a variable; readable by the container's user, and a volume that
follows the Secret, so SIGHUP reloads what the Secret holds now (issue 39, item 9)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from gateway.limits import load_keys_file
from tests.deploy.manifests import (
    OVERLAYS,
    ROOT,
    Container,
    compose_containers,
    interpolate,
    k8s_containers,
    load_compose,
    pod_spec,
    render,
)

KEYS_FILE = "CTX_GATEWAY_API_KEYS_FILE"


def key_file_errors(c: Container, tmp: Path, mode: int = 0o600) -> list[str]:
    """What is wrong with how a gateway container gets its keys (`mode`: the file's, as
    mounted; the gateway refuses one that every user can write)."""
    errors = []
    if any(a == "--api-key" or a.startswith("--api-key=") for a in c.argv):
        errors.append(f"{c.where}: a key on the command line")
    if "CTX_GATEWAY_API_KEYS" in c.env:
        errors.append(f"{c.where}: keys in a variable, not the keys file")
    path = c.env.get(KEYS_FILE)
    if path is None or path not in c.files:
        return [*errors, f"{c.where}: {KEYS_FILE} names no mounted secret file"]
    local = tmp / "keys.json"
    local.write_text(c.files[path])
    local.chmod(mode)
    try:
        load_keys_file(local)
    except ValueError as exc:
        errors.append(f"{c.where}: {exc}")
    return errors


def gateways(containers: list[Container]) -> list[Container]:
    found = [c for c in containers if c.ctxcache_command == "gateway"]
    assert found, "no gateway container"
    return found


def test_compose_mounts_the_keys_file_readable_by_the_image_user(tmp_path: Path) -> None:
    compose = load_compose()
    (gateway,) = gateways(list(compose_containers(compose)))
    source = ROOT / interpolate(compose["secrets"]["api-keys"]["file"])
    # a compose secret is a bind mount of the file, its mode as in the checkout
    assert key_file_errors(gateway, tmp_path, stat.S_IMODE(source.stat().st_mode)) == []
    # the image's user (10001) must read it
    assert source.stat().st_mode & stat.S_IROTH, f"{source} is not readable by uid 10001"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_kubernetes_mounts_the_keys_file_from_the_secret(overlay: str, tmp_path: Path) -> None:
    docs = render(overlay)
    (gateway,) = gateways(list(k8s_containers(docs)))
    pod = next(
        pod_spec(d)
        for d in docs
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "gateway"
    )
    assert pod is not None
    mount = next(
        m
        for m in gateway.raw["volumeMounts"]
        if gateway.env[KEYS_FILE].startswith(m["mountPath"].rstrip("/") + "/")
    )
    assert mount.get("readOnly") and "subPath" not in mount  # a subPath never sees updates
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    mode = volume["secret"].get("defaultMode", 0o644)
    user = pod["securityContext"]
    # with an fsGroup the kubelet makes a Secret's files group-readable (mode | 0440)
    mounted = mode | (0o440 if user.get("fsGroup") is not None else 0)
    assert key_file_errors(gateway, tmp_path, mounted) == []
    assert not mounted & (stat.S_IWGRP | stat.S_IWOTH), f"others may write it ({mounted:04o})"
    readable = mode & stat.S_IROTH or (
        mode & stat.S_IRGRP and user.get("fsGroup") == user.get("runAsGroup")
    )
    assert readable, "the keys file is not readable by the gateway's user"


def test_the_check_catches_a_key_on_the_command_line_or_in_a_variable(tmp_path: Path) -> None:
    (gateway,) = gateways(list(compose_containers(load_compose())))
    flag = Container(
        where="flag",
        image="",
        argv=[*gateway.argv, "--api-key", "sk-x=t"],
        env=gateway.env,
        files=gateway.files,
    )
    variable = Container(
        where="variable",
        image="",
        argv=gateway.argv,
        env={"CTX_GATEWAY_API_KEYS": '{"sk-x": "t"}'},
    )
    bad_file = Container(
        where="bad",
        image="",
        argv=gateway.argv,
        env=gateway.env,
        files={p: '{"sk-x": "t", "sk-x": "u"}' for p in gateway.files},
    )
    assert key_file_errors(flag, tmp_path) == ["flag: a key on the command line"]
    assert len(key_file_errors(variable, tmp_path)) == 2
    assert "a key is given twice" in key_file_errors(bad_file, tmp_path)[0]
    assert "every user can write it (mode 0666)" in key_file_errors(gateway, tmp_path, 0o666)[0]
