"""What a schema validator cannot see: the deployment files agree with ctxcache itself.

Every `CTX_*` variable is a field of the settings class of the service that reads it,
every `ctxcache` flag parses, every health probe names a real route on the right port,
LMCache / vLLM run with the settings ctxcache's KV layout needs, only the gateway is
reachable from outside, and the gateway's worker list matches the worker pods.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from pydantic_settings import SettingsError

from ctxcache.cli import build_parser
from tests.deploy.manifests import (
    DOCKERFILE,
    HEALTH_PORT_FIELD,
    OVERLAYS,
    PACKAGES,
    ROOT,
    SETTINGS,
    VLLM_HEALTH_PATHS,
    Container,
    compose_containers,
    find,
    flag_value,
    from_vllm_image,
    interpolate,
    k8s_containers,
    kv_transfer_config,
    lmcache_config_keys,
    load_compose,
    render,
    route_table,
    shell_ctxcache_commands,
)
from worker.settings import WorkerSettings

CHUNK_SIZE = WorkerSettings.model_fields["chunk_size"].default  # 256, SPEC.md


def all_containers() -> list[Container]:
    found = list(compose_containers(load_compose()))
    for overlay in OVERLAYS:
        found += list(k8s_containers(render(overlay)))
    return found


def ctx_variable_errors(container: Container) -> list[str]:
    """CTX_<SERVICE>_<FIELD> must be a field of that service's settings, and the service
    must be the one this container runs."""
    errors = []
    for name in container.env:
        m = re.fullmatch(r"CTX_([A-Z]+)_([A-Z0-9_]+)", name)
        if not name.startswith("CTX_"):
            continue
        service = m.group(1).lower() if m else ""
        if service not in SETTINGS:
            errors.append(f"{container.where}: {name}: no service {service!r}")
        elif m and m.group(2).lower() not in SETTINGS[service].model_fields:
            errors.append(f"{container.where}: {name}: not a field of {service} settings")
        elif container.ctxcache_command not in (service, None):
            errors.append(f"{container.where}: {name} given to `{container.ctxcache_command}`")
    return errors


def settings_errors(container: Container, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The container's CTX_ values must build its settings (types, JSON, validators)."""
    command = container.ctxcache_command
    if command not in SETTINGS:
        return []
    with monkeypatch.context() as m, tempfile.TemporaryDirectory() as mounted:
        for name in [n for n in os.environ if n.startswith("CTX_")]:
            m.delenv(name)
        for name, value in container.env.items():
            if value in container.files:  # a mounted file (the keys file): its content here
                local = Path(mounted) / name
                local.write_text(container.files[value])
                value = str(local)
            m.setenv(name, value)
        try:
            extra: dict[str, Any] = {"model": "x"} if command == "worker" else {}
            SETTINGS[command](**extra)
        except (ValidationError, SettingsError) as e:
            return [f"{container.where}: {e}"]
    return []


def test_every_ctx_variable_is_a_settings_field_of_its_service(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    containers = all_containers()
    assert sum(1 for c in containers for n in c.env if n.startswith("CTX_")) > 20
    errors = [e for c in containers for e in ctx_variable_errors(c)]
    errors += [e for c in containers for e in settings_errors(c, monkeypatch)]
    assert errors == []


def test_a_misspelled_or_misplaced_variable_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    gateway = Container("t/gateway", "ctxcache", ["ctxcache", "gateway"])
    gateway.env = {"CTX_GATEWAY_WORKER": "[]", "CTX_MANAGER_TOKEN": "t", "CTX_GATWAY_PORT": "1"}
    assert len(ctx_variable_errors(gateway)) == 3
    gateway.env = {"CTX_GATEWAY_WORKERS": "[{'url': 'not json'}]"}
    assert settings_errors(gateway, monkeypatch)


def test_every_ctxcache_command_line_parses() -> None:
    parser = build_parser()
    lines = []
    for c in all_containers():
        if c.ctxcache_command:
            lines.append(c.argv[1:])
        lines += shell_ctxcache_commands(c)
    assert {line[0] for line in lines} >= {"gateway", "manager", "sidecar", "vllm", "model"}
    # the engine is a choice (CTXCACHE_ENGINE, the worker-engine ConfigMap): both must parse
    lines += [["worker", *line[1:]] for line in lines if line[0] == "vllm"]
    for line in lines:
        try:
            parser.parse_args(line)
        except SystemExit:
            pytest.fail(f"`ctxcache {' '.join(line)}` does not parse")
    with pytest.raises(SystemExit):
        parser.parse_args(["worker", "--model", "m", "--chunk-sizes", "256"])


@pytest.mark.parametrize("service", sorted(PACKAGES))
def test_route_table_knows_the_health_routes(service: str) -> None:
    routes = route_table(PACKAGES[service])
    assert "/health" in routes
    assert "/nope" not in routes


# compose's monitoring services: their own readiness routes, on their default ports
MONITORING_HEALTH = {
    "prometheus": ("/-/ready", 9090),
    "grafana": ("/api/health", 3000),
    "redis-exporter": ("/health", 9121),  # redis_exporter's own route and default port
}


def test_health_probes_point_at_real_routes_on_the_right_port() -> None:
    checked = 0
    for c in all_containers():
        for path, port in c.probes:
            checked += 1
            if c.ctxcache_command == "vllm":  # `ctxcache vllm` is vLLM's own server
                assert path in VLLM_HEALTH_PATHS, f"{c.where}: {path}"
                default = build_parser().parse_args(["vllm", "--model", "m"]).port
                assert c.probe_port(port) == int(flag_value(c.argv, "--port") or default)
            elif command := c.ctxcache_command:
                assert path in route_table(PACKAGES[command]), f"{c.where}: {path}"
                expected = listen_port(c, command)
                assert c.probe_port(port) == expected, f"{c.where}: probes port {port}"
            elif (name := c.where.split("/")[-1]) in MONITORING_HEALTH:  # profile monitoring
                assert (path, c.probe_port(port)) == MONITORING_HEALTH[name], c.where
            else:
                assert "vllm" in c.image, c.where
                assert path in VLLM_HEALTH_PATHS, f"{c.where}: {path}"
                assert c.probe_port(port) == int(flag_value(c.argv, "--port") or 8000)
    assert checked >= 15
    gateway = find(render("cpu"), "Deployment", "gateway")["spec"]["template"]["spec"]
    probes = gateway["containers"][0]
    assert probes["livenessProbe"]["httpGet"]["path"] == "/health"
    assert probes["readinessProbe"]["httpGet"]["path"] == "/ready"


def listen_port(c: Container, command: str) -> int:
    """The port a ctxcache service of this container answers /health on."""
    field = HEALTH_PORT_FIELD[command]
    flag = "--" + field.replace("_", "-")
    value = flag_value(c.argv, flag) or c.env.get(f"CTX_{command.upper()}_{field.upper()}")
    default = SETTINGS[command].model_fields[field].default
    return int(value) if value is not None else int(default)


# ---- LMCache / vLLM ---------------------------------------------------------------------


def test_vllm_and_lmcache_settings_agree_with_ctxcache() -> None:
    keys = lmcache_config_keys()
    assert {"chunk_size", "remote_url", "save_decode_cache"} <= keys
    connectors: list[str] = []
    for c in [c for c in all_containers() if from_vllm_image(c)]:
        assert c.env["PYTHONHASHSEED"] == "0", c.where
        assert "--enable-prompt-tokens-details" in c.argv, c.where
        kv = kv_transfer_config(c)
        connectors.append(kv.get("kv_connector", ""))
        lmcache = {n: v for n, v in c.env.items() if n.startswith("LMCACHE_")}
        if kv.get("kv_connector") == "CtxcacheConnector":
            # ours (components/ctxcache-connector-gpu, checked in test_gpu_connector.py):
            # LMCache is not loaded, so none of its settings are left to mislead
            assert lmcache == {}, c.where
            continue
        unknown = {n for n in lmcache if n.removeprefix("LMCACHE_").lower() not in keys}
        assert unknown == set(), f"{c.where}: not LMCache 0.5.6 settings"
        assert int(lmcache["LMCACHE_CHUNK_SIZE"]) == CHUNK_SIZE, c.where
        assert lmcache["LMCACHE_SAVE_DECODE_CACHE"].lower() == "true", c.where
        assert lmcache.get("LMCACHE_REMOTE_SERDE", "naive") == "naive", c.where
        assert re.fullmatch(r"lm://[\w.-]+:65432", lmcache["LMCACHE_REMOTE_URL"]), c.where
        assert kv == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, c.where
    # compose's gpu profile and overlays/gpu on LMCache's, overlays/gpu-ctxcache on ours
    assert sorted(connectors) == [
        "CtxcacheConnector",
        "LMCacheConnectorV1",
        "LMCacheConnectorV1",
    ], connectors


def test_lmcache_remote_url_reaches_the_sidecar_data_port() -> None:
    compose = load_compose()
    vllm = compose["services"]["vllm"]
    assert vllm["environment"]["LMCACHE_REMOTE_URL"] == "lm://sidecar:65432"
    assert flag_value(compose["services"]["sidecar"]["command"], "--port") == "65432"
    assert "gpu" in vllm["profiles"] and "gpu" in str(vllm["deploy"]["resources"])
    pod = find(render("gpu"), "StatefulSet", "worker")["spec"]["template"]["spec"]
    names = {c["name"] for c in pod["containers"]}
    assert names == {"worker", "sidecar"}, "vLLM and the sidecar share the pod"
    sidecar = next(c for c in k8s_containers(render("gpu")) if c.where.endswith("/sidecar"))
    assert sidecar.env["CTX_SIDECAR_PORT"] == "65432"
    vllm_pod = next(c for c in pod["containers"] if c["name"] == "worker")
    assert vllm_pod["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"medium": "Memory"}.items() <= next(
        v["emptyDir"] for v in pod["volumes"] if v["name"] == "dshm"
    ).items()
    assert pod["tolerations"] and pod["nodeSelector"]


def test_cpu_workers_use_the_same_chunk_size_and_their_sidecar() -> None:
    workers = [c for c in all_containers() if c.ctxcache_command in {"worker", "vllm"}]
    assert len(workers) == 3  # compose cpu profile, the cpu overlay and external-redis on it
    assert {c.ctxcache_command for c in workers} == {"vllm"}  # vLLM unless told otherwise
    for c in workers:
        assert int(flag_value(c.argv, "--chunk-size") or CHUNK_SIZE) == CHUNK_SIZE
        assert (flag_value(c.argv, "--sidecar") or "").endswith(":65432"), c.where


def runs_vllm(c: Container) -> bool:
    """vLLM itself: `ctxcache vllm` (the CPU build), or a vLLM image / `vllm serve`."""
    return c.ctxcache_command == "vllm" or "vllm" in c.image or c.argv[:1] == ["vllm"]


def shm_errors(pod: dict[str, Any], container: dict[str, Any]) -> list[str]:
    """/dev/shm of this container must be a memory-backed emptyDir with a size limit."""
    mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
    if not mounts:
        return ["no volume mounted at /dev/shm (the default is 64 MiB; vLLM needs more)"]
    volume = next((v for v in pod.get("volumes", []) if v["name"] == mounts[0]["name"]), {})
    empty_dir = volume.get("emptyDir")
    if empty_dir is None or empty_dir.get("medium") != "Memory":
        return [f"/dev/shm volume {mounts[0]['name']!r} is not an emptyDir with medium Memory"]
    if "sizeLimit" not in empty_dir:
        return [f"/dev/shm volume {mounts[0]['name']!r} has no sizeLimit"]
    return []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_vllm_container_has_a_memory_backed_dev_shm(overlay: str) -> None:
    docs = render(overlay)
    vllm = [c for c in k8s_containers(docs) if runs_vllm(c)]
    assert vllm, f"{overlay}: no vLLM container found"
    for c in vllm:
        kind, name, _ = c.where.split("/")
        pod = find(docs, kind, name)["spec"]["template"]["spec"]
        assert shm_errors(pod, c.raw) == [], c.where


def test_the_shm_check_catches_a_missing_or_unbounded_dev_shm() -> None:
    pod = find(render("cpu"), "StatefulSet", "worker")["spec"]["template"]["spec"]
    worker = next(c for c in pod["containers"] if c["name"] == "worker")
    assert shm_errors(pod, worker) == []
    bare = {**worker, "volumeMounts": [m for m in worker["volumeMounts"] if m["name"] != "dshm"]}
    assert "no volume mounted" in shm_errors(pod, bare)[0]
    volumes = [v for v in pod["volumes"] if v["name"] != "dshm"]
    unbounded = {**pod, "volumes": [*volumes, {"name": "dshm", "emptyDir": {"medium": "Memory"}}]}
    assert "no sizeLimit" in shm_errors(unbounded, worker)[0]
    on_disk = {**pod, "volumes": [*volumes, {"name": "dshm", "emptyDir": {"sizeLimit": "1Gi"}}]}
    assert "medium Memory" in shm_errors(on_disk, worker)[0]


def test_every_compose_vllm_service_has_room_in_dev_shm() -> None:
    services = load_compose()["services"]
    vllm = [c for c in compose_containers(load_compose()) if runs_vllm(c)]
    assert {c.where for c in vllm} == {"compose/worker", "compose/vllm"}
    for c in vllm:
        svc = services[c.where.removeprefix("compose/")]
        if svc.get("ipc") == "host":
            continue
        size = interpolate(str(svc.get("shm_size", "")))
        m = re.fullmatch(r"(\d+)([kmg]?)b?", size.lower())
        assert m, f"{c.where}: no shm_size"
        scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2)]
        assert int(m.group(1)) * scale >= 160 << 20, f"{c.where}: vLLM needs 160 MiB in /dev/shm"


# ---- exposure and topology ----------------------------------------------------------------


def test_only_the_gateway_is_reachable_from_outside() -> None:
    compose = load_compose()
    published = {n: s["ports"] for n, s in compose["services"].items() if "ports" in s}
    # the monitoring UIs (profile `monitoring`) publish on the machine's loopback only
    loopback = {"prometheus", "grafana"}
    assert set(published) == {"gateway", *loopback}
    for name in loopback:
        assert all(str(p).startswith("127.0.0.1:") for p in published[name]), name
    assert not str(published["gateway"][0]).startswith("127.0.0.1:")
    for overlay in OVERLAYS:
        docs = render(overlay)
        exposed = [
            d["metadata"]["name"]
            for d in docs
            if d["kind"] == "Service" and d["spec"].get("type") in {"LoadBalancer", "NodePort"}
        ]
        assert exposed == ["gateway"]
        policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
        deny = [
            p for p in policies if p["spec"]["podSelector"] == {} and "ingress" not in p["spec"]
        ]
        assert deny, "a default-deny ingress policy"
        open_to_all = [
            p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
            for p in policies
            if any("from" not in rule for rule in p["spec"].get("ingress", []))
        ]
        assert open_to_all == ["gateway"]


def test_gateway_is_replicated_autoscaled_and_disruption_safe() -> None:
    docs = render("gpu")
    assert find(docs, "Deployment", "gateway")["spec"]["replicas"] >= 2
    hpa = find(docs, "HorizontalPodAutoscaler", "gateway")["spec"]
    assert hpa["scaleTargetRef"]["name"] == "gateway" and hpa["minReplicas"] >= 2
    pdb = find(docs, "PodDisruptionBudget", "gateway")["spec"]
    assert pdb["selector"]["matchLabels"]["app.kubernetes.io/name"] == "gateway"
    redis = find(docs, "StatefulSet", "redis")["spec"]
    assert "--appendonly" in redis["template"]["spec"]["containers"][0]["args"]
    assert redis["volumeClaimTemplates"]
    for d in docs:
        if spec := d.get("spec", {}).get("template", {}).get("spec"):
            for c in spec["containers"]:
                assert {"requests", "limits"} <= set(c.get("resources", {})), c["name"]


def test_external_redis_overlay_points_the_manager_at_a_cluster_and_runs_no_redis() -> None:
    from cache_manager.redis_url import parse_store_url
    from cache_manager.settings import ManagerSettings

    docs = render("external-redis")
    data = find(docs, "ConfigMap", "manager-config")["data"]
    assert parse_store_url(data["CTX_MANAGER_REDIS_URL"]).topology in {"cluster", "sentinel"}
    settings = ManagerSettings(
        **{k.removeprefix("CTX_MANAGER_").lower(): v for k, v in data.items()}
    )  # valid together: the replica wait is shorter than the socket timeout
    assert settings.redis_wait_replicas >= 1
    assert find(docs, "StatefulSet", "redis")["spec"]["replicas"] == 0
    assert find(render("cpu"), "StatefulSet", "redis")["spec"].get("replicas", 1) == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_worker_list_names_every_worker_pod(overlay: str) -> None:
    docs = render(overlay)
    workers = json.loads(find(docs, "ConfigMap", "gateway-config")["data"]["CTX_GATEWAY_WORKERS"])
    sts = find(docs, "StatefulSet", "worker")
    headless = find(docs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    expected = [
        {
            "id": f"worker-{i}",
            "url": f"http://worker-{i}.worker:8100",
            "sidecar": f"http://worker-{i}.worker:8200",
        }
        for i in range(sts["spec"]["replicas"])
    ]
    assert workers == expected


def test_compose_services_are_health_gated() -> None:
    services = load_compose()["services"]
    for name, svc in services.items():
        if name != "model-init":
            assert "healthcheck" in svc, name
        for dep, cond in (svc.get("depends_on") or {}).items():
            wanted = "service_completed_successfully" if dep == "model-init" else "service_healthy"
            assert cond["condition"] == wanted, f"{name} -> {dep}"
    gateway = services["gateway"]
    assert gateway["environment"]["CTX_GATEWAY_MANAGER_URL"] == "http://manager:8300"
    assert interpolate(services["redis"]["image"]) == "redis:7"
    assert services["redis"]["image"].startswith("${CTXCACHE_REDIS_IMAGE:-")  # a mirror's


def test_compose_builds_the_image_once_and_the_others_use_it_by_name() -> None:
    services = load_compose()["services"]
    builders = [n for n, s in services.items() if "build" in s]
    assert builders == ["gateway"]
    image = services["gateway"]["image"]
    ours = [n for n, s in services.items() if s.get("image") == image]
    assert {"manager", "sidecar", "model-init", "worker", "gateway"} <= set(ours)
    build = services["gateway"]["build"]
    assert build["dockerfile"] == "deploy/Dockerfile"
    # every source of the build can be pointed at a mirror; the defaults are the public ones
    defaults = {k: interpolate(str(v)) for k, v in build["args"].items()}
    assert defaults == {
        "PYTHON_IMAGE": "python:3.11-slim-bookworm",
        "PIP_INDEX_URL": "https://pypi.org/simple",
        "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cpu",
        "EXTRA_CA_CERTS": "",
    }
    dockerfile = DOCKERFILE.read_text()
    for arg, default in defaults.items():
        assert f"ARG {arg}={default}" in dockerfile, arg
    assert "--appendonly" in services["redis"]["command"]


# ---- Dockerfile ---------------------------------------------------------------------------


def test_dockerfile_is_multi_stage_non_root_cpu_torch_first() -> None:
    text = DOCKERFILE.read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert sum(ln.startswith("FROM ") for ln in lines) >= 2
    torch = text.index("install-torch.sh 2.13.0+cpu")
    assert torch < text.index('pip install --index-url "$PIP_INDEX_URL"')
    # vLLM's CPU build runs without the torchvision/torchaudio wheels that break CPU torch
    assert "pip uninstall -y torchvision torchaudio torchcodec" in text
    # vLLM's CPU extensions link libnuma.so.1
    assert "libnuma1" in text
    assert "COPY --from=builder /opt/venv /opt/venv" in text
    user = next(ln for ln in reversed(lines) if ln.startswith("USER "))
    assert user.split()[1] not in {"root", "0"}
    assert any(ln.startswith("HEALTHCHECK ") for ln in lines)
    assert 'ENTRYPOINT ["ctxcache"]' in lines
    # every package the distribution ships is copied into the build
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    ]
    for package in packages:
        assert f"COPY {package} ./{package}" in text, package
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests"} <= set(ignored)
