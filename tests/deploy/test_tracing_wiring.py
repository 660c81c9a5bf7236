"""Tracing in every deployment form (docs/operations.md, "Tracing"): one setting per form
turns it on, and it is off until given. Compose passes the shell's OTEL_EXPORTER_OTLP_ENDPOINT
(empty by default) to every ctxcache service and to vLLM; in Kubernetes every ctxcache
container and the GPU overlay's vLLM read the key of the `tracing-config` ConfigMap (empty).

A vLLM started with its own entrypoint traces only when given `--otlp-traces-endpoint`; its
shell wrapper is run here through a real `sh -c` with a fake `vllm` that prints what it was
given, so the flag must appear exactly when the endpoint is set, with vLLM's other arguments
unchanged. `ctxcache vllm` adds the flag itself, from the same variable.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ctxcache import tracing
from ctxcache.cli import build_parser
from ctxcache.vllm_engine import VllmLaunch
from tests.deploy.manifests import (
    OVERLAYS,
    Container,
    compose_containers,
    expand_k8s_vars,
    find,
    flag_value,
    from_vllm_image,
    k8s_containers,
    load_compose,
    pod_spec,
    render,
)

KEY = tracing.ENDPOINT_ENV
CONFIGMAP = "tracing-config"
FLAG = "--otlp-traces-endpoint"
ENDPOINT = "http://otel-collector.monitoring:4318"
FORMS = ("compose", *OVERLAYS)
SERVICES = {"gateway", "manager", "sidecar", "worker", "vllm"}  # `ctxcache <command>`s
VLLM_ENTRYPOINT = ["vllm", "serve"]  # the image's own, where a form does not replace it

# what must join a trace in each form: every ctxcache service and every vLLM
TRACED = {
    "compose": {f"compose/{name}" for name in ("gateway", "manager", "sidecar", "worker", "vllm")},
    **{
        overlay: {
            "Deployment/gateway/gateway",
            "Deployment/manager/manager",
            "StatefulSet/worker/worker",
            "StatefulSet/worker/sidecar",
        }
        for overlay in OVERLAYS
    },
}
# where vLLM runs from its own image (the others run `ctxcache vllm`)
PLAIN_VLLM = {
    "compose": {"compose/vllm"},
    **{overlay: {"StatefulSet/worker/worker"} for overlay in ("gpu", "gpu-ctxcache")},
}

COMPOSE_VALUE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?)-([^}]*))?\}")


def compose_value(value: str, shell: dict[str, str]) -> str:
    """Compose's interpolation of one value, `shell` being the variables of the shell that
    runs `docker compose`: `${VAR}`, `${VAR:-default}` (unset or empty), `${VAR-default}`
    (unset), and `$$`, a `$` left for the container."""

    def one(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, colon, default = m.groups()
        value = shell.get(name)
        if value is None or (colon and value == ""):
            return default or ""
        return value

    return COMPOSE_VALUE.sub(one, value)


def is_ours(c: Container) -> bool:
    return c.image.split("@")[0].rsplit(":", 1)[0].endswith("ctxcache")


def plain_vllm(c: Container) -> bool:
    return from_vllm_image(c)


def traced(c: Container) -> bool:
    """A ctxcache service or a vLLM (not Redis, the monitoring, or a one-shot init step)."""
    return c.ctxcache_command in SERVICES or plain_vllm(c)


def containers(form: str, given: dict[str, str] | None = None) -> list[Container]:
    """The containers of a form as they run with the tracing settings `given`: the shell's
    variables for compose, the data of the `tracing-config` ConfigMap for Kubernetes
    (None: the files as they are)."""
    if form != "compose":
        docs = render(form)
        if given is not None:
            docs = copy.deepcopy(docs)
            find(docs, "ConfigMap", CONFIGMAP)["data"] = dict(given)
        return list(k8s_containers(docs))
    found = []
    for c in compose_containers(load_compose()):
        svc = c.raw
        entry = svc.get("entrypoint", ["ctxcache"] if is_ours(c) else [])
        argv = [compose_value(str(a), given or {}) for a in [*entry, *svc.get("command", [])]]
        env = {
            k: compose_value(str(v), given or {}) for k, v in (svc.get("environment") or {}).items()
        }
        found.append(dataclasses.replace(c, argv=argv, env=env))
    return found


def traced_containers(form: str, given: dict[str, str] | None = None) -> dict[str, Container]:
    return {c.where: c for c in containers(form, given) if traced(c)}


# ---- the setting reaches every service ----------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
def test_every_service_and_vllm_gets_the_endpoint_from_the_one_setting(form: str) -> None:
    off = traced_containers(form)
    assert set(off) == TRACED[form]
    # off by default: the variable is there, empty (what every service reads as off)
    assert {w: c.env.get(KEY) for w, c in off.items()} == dict.fromkeys(TRACED[form], "")
    on = traced_containers(form, {KEY: ENDPOINT})
    assert {w: c.env.get(KEY) for w, c in on.items()} == dict.fromkeys(TRACED[form], ENDPOINT)
    # a ctxcache container this test does not count as traced can only be a one-shot step
    untraced = {c.where for c in containers(form) if is_ours(c) and not traced(c)}
    assert all(w.endswith("/model-init") for w in untraced), untraced


def test_the_kubernetes_setting_is_one_optional_configmap_key() -> None:
    for overlay in OVERLAYS:
        docs = render(overlay)
        assert find(docs, "ConfigMap", CONFIGMAP)["data"] == {KEY: ""}
        refs: dict[str, list[dict[str, object]]] = {}
        for doc in docs:
            spec = pod_spec(doc)
            for raw in spec["containers"] if spec else []:
                where = f"{doc['kind']}/{doc['metadata']['name']}/{raw['name']}"
                sources = [s["configMapRef"] for s in raw.get("envFrom", [])]
                sources += [
                    v["valueFrom"]["configMapKeyRef"]
                    for v in raw.get("env", [])
                    if "configMapKeyRef" in v.get("valueFrom", {})
                ]
                refs[where] = [s for s in sources if s.get("name") == CONFIGMAP]
        assert {w for w, found in refs.items() if found} == TRACED[overlay], overlay
        # a pod still starts where the ConfigMap is managed elsewhere, or deleted
        assert all(r.get("optional") is True for found in refs.values() for r in found)


# ---- vLLM adds its flag only when the endpoint is set ------------------------------------


@pytest.fixture
def fake_vllm(tmp_path: Path) -> Path:
    """A directory holding a `vllm` that prints its arguments as JSON."""
    exe = tmp_path / "vllm"
    exe.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    exe.chmod(0o755)
    return tmp_path


def vllm_args(c: Container, given: dict[str, str]) -> list[str]:
    """The arguments the form gives vLLM (compose's command, the container's args)."""
    if c.where.startswith("compose/"):
        return [compose_value(str(a), given) for a in c.raw.get("command", [])]
    return [expand_k8s_vars(str(a), c.env) for a in c.raw.get("args", [])]


def launch(c: Container, bin_dir: Path, shell: str) -> list[str]:
    """What the container's `vllm` is started with, run through a real shell."""
    replaced = c.raw.get("entrypoint" if c.where.startswith("compose/") else "command")
    argv = c.argv if replaced else [*VLLM_ENTRYPOINT, *c.argv]
    if argv[0] == "sh":
        argv = [shell, *argv[1:]]
    env = {**c.env, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=True)
    return list(json.loads(done.stdout))


def launch_errors(
    c: Container, args: list[str], endpoint: str | None, bin_dir: Path, shell: str
) -> list[str]:
    """What is wrong with how vLLM starts with `endpoint` set (None: unset, "": empty)."""
    got = launch(c, bin_dir, shell)
    errors = []
    if got.count(FLAG) + sum(a.startswith(FLAG + "=") for a in got) > 1:
        errors.append(f"{FLAG} given more than once: {got}")
    url = flag_value(got, FLAG)
    expected = tracing.traces_url(endpoint) if endpoint else None
    if url != expected:
        errors.append(f"endpoint {endpoint!r}: {FLAG} {url!r}, expected {expected!r}")
    rest = [a for i, a in enumerate(got) if a != FLAG and (i == 0 or got[i - 1] != FLAG)]
    rest = [a for a in rest if not a.startswith(FLAG + "=")]
    if rest != ["serve", *args]:
        errors.append(f"vLLM's arguments changed: {rest} != {['serve', *args]}")
    return errors


CASES = {"set": ENDPOINT, "trailing-slash": ENDPOINT + "/", "empty": "", "unset": None}


def shells() -> list[str]:
    """`sh` (dash on Debian and Ubuntu, as in vLLM's image) and bash where there is one."""
    return [s for s in ("sh", "bash") if shutil.which(s)]


@pytest.mark.parametrize("shell", shells())
@pytest.mark.parametrize("form", FORMS)
def test_plain_vllm_gets_the_traces_flag_only_when_the_endpoint_is_set(
    form: str, shell: str, fake_vllm: Path
) -> None:
    found = {w for w, c in traced_containers(form).items() if plain_vllm(c)}
    assert found == PLAIN_VLLM.get(form, set())
    for where in found:
        errors = []
        for endpoint in CASES.values():
            given = {} if endpoint is None else {KEY: endpoint}
            c = traced_containers(form, given)[where]
            assert (c.env.get(KEY) or None) == (endpoint or None)  # (compose: "" when unset)
            errors += launch_errors(c, vllm_args(c, given), endpoint, fake_vllm, shell)
        assert errors == [], where
        # OTLP over HTTP, as for ctxcache's services (vLLM's default is gRPC), named `vllm`
        assert c.env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf", where
        assert c.env["OTEL_SERVICE_NAME"] == "vllm", where


# broken wrappers, each of which the check above must catch (None: the file's own command)
ALWAYS = f'exec vllm serve "$@" {FLAG} "${KEY}/v1/traces"'
ARGS_LOST = f"exec vllm serve ${{{KEY}:+{FLAG} ${KEY}/v1/traces}}"


@pytest.mark.parametrize(
    ("command", "endpoint", "expected"),
    [
        (None, ENDPOINT, None),
        (None, "", None),
        (["sh", "-c", ALWAYS, "vllm"], "", "expected None"),
        (["sh", "-c", ALWAYS, "vllm"], None, "expected None"),
        (VLLM_ENTRYPOINT, ENDPOINT, "expected 'http"),
        (["sh", "-c", ARGS_LOST, "vllm"], ENDPOINT, "arguments changed"),
    ],
    ids=["as-is-on", "as-is-off", "always-empty", "always-unset", "no-wrapper", "args-lost"],
)
def test_the_flag_check_catches_an_unconditional_or_missing_flag(
    command: list[str] | None, endpoint: str | None, expected: str | None, fake_vllm: Path
) -> None:
    given = {} if endpoint is None else {KEY: endpoint}
    c = traced_containers("gpu", given)["StatefulSet/worker/worker"]
    args = vllm_args(c, given)
    if command is not None:
        c = dataclasses.replace(c, argv=[*command, *args], raw={**c.raw, "command": command})
    errors = launch_errors(c, args, endpoint, fake_vllm, "sh")
    if expected is None:
        assert errors == []
    else:
        assert len(errors) == 1 and expected in errors[0], errors


# `ctxcache vllm` (the CPU engine) builds vLLM's command line itself
CTXCACHE_VLLM = {
    "compose": {"compose/worker"},
    **{overlay: {"StatefulSet/worker/worker"} for overlay in ("cpu", "external-redis")},
}


@pytest.mark.parametrize("form", FORMS)
def test_ctxcache_vllm_adds_the_flag_only_when_the_endpoint_is_set(
    form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engines = {w for w, c in traced_containers(form).items() if c.ctxcache_command == "vllm"}
    assert engines == CTXCACHE_VLLM.get(form, set())
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_SERVICE_NAME"):
        monkeypatch.delenv(name, raising=False)
    for endpoint in CASES.values():
        given = {} if endpoint is None else {KEY: endpoint}
        for where in engines:
            c = traced_containers(form, given)[where]
            if KEY in c.env:  # the container's environment is the engine's
                monkeypatch.setenv(KEY, c.env[KEY])
            else:
                monkeypatch.delenv(KEY, raising=False)
            args = build_parser().parse_args(c.argv[1:])
            run = VllmLaunch(model=args.model, served_name="m", port=args.port)
            expected = tracing.traces_url(endpoint) if endpoint else None
            assert flag_value(run.argv(), FLAG) == expected, (where, endpoint)
            assert run.env().get("OTEL_SERVICE_NAME") == ("vllm" if endpoint else None)
