"""Loading the deployment files and the facts about ctxcache they must agree with.

Everything here is static: files are parsed, never deployed; routes and LMCache's
configuration keys are read from the source with `ast`, so no torch import is needed.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from pydantic_settings import BaseSettings

from cache_manager.settings import ManagerSettings
from gateway.settings import GatewaySettings
from sidecar.settings import SidecarSettings
from tests.deploy import kustomize_lite
from worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu", "gpu-ctxcache", "external-redis")

Doc = dict[str, Any]

# `ctxcache <command>` -> the settings class it reads, the package its routes live in
SETTINGS: dict[str, type[BaseSettings]] = {
    "gateway": GatewaySettings,
    "manager": ManagerSettings,
    "sidecar": SidecarSettings,
    "worker": WorkerSettings,
}
PACKAGES = {
    "gateway": "gateway",
    "manager": "cache_manager",
    "sidecar": "sidecar",
    "worker": "worker",
}
# what each service listens on by default (the port its health route answers on)
HEALTH_PORT_FIELD = {
    "gateway": "port",
    "manager": "port",
    "sidecar": "control_port",
    "worker": "port",
}
VLLM_HEALTH_PATHS = {"/health"}  # vLLM's OpenAI server: liveness + readiness

CTX_NAME = re.compile(r"^CTX_([A-Z]+)_([A-Z0-9_]+)$")
INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


# ---- kustomize ------------------------------------------------------------------------


def real_kustomize() -> list[str] | None:
    """The command of a real kustomize on this machine, if any."""
    if exe := shutil.which("kustomize"):
        return [exe, "build"]
    if exe := shutil.which("kubectl"):
        probe = subprocess.run(
            [exe, "kustomize", "--help"], capture_output=True, timeout=30, check=False
        )
        if probe.returncode == 0:
            return [exe, "kustomize"]
    return None


def render_real(overlay: Path, command: list[str]) -> list[Doc]:
    out = subprocess.run(
        [*command, str(overlay)], capture_output=True, text=True, timeout=60, check=True
    )
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def render(overlay: str) -> list[Doc]:
    """An overlay rendered by the minimal renderer (always available, offline)."""
    return kustomize_lite.render(K8S / "overlays" / overlay)


def key(doc: Doc) -> tuple[str, str, str, str]:
    meta = doc["metadata"]
    return (doc["apiVersion"], doc["kind"], meta.get("namespace", ""), meta["name"])


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind}/{name}, found {len(matches)}"
    return matches[0]


# ---- containers -------------------------------------------------------------------------


@dataclass
class Container:
    """A container of a rendered workload or a compose service, normalized."""

    where: str
    image: str
    argv: list[str]  # entrypoint/command + args, `ctxcache` first for our image
    env: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)  # port name -> number
    probes: list[tuple[str, int | str]] = field(default_factory=list)  # (path, port)
    raw: Doc = field(default_factory=dict)
    # files mounted from a Secret (k8s) or a compose secret: path inside -> content
    files: dict[str, str] = field(default_factory=dict)

    @property
    def ctxcache_command(self) -> str | None:
        if len(self.argv) >= 2 and Path(self.argv[0]).name == "ctxcache":
            return self.argv[1]
        return None

    def probe_port(self, port: int | str) -> int:
        return self.ports[port] if isinstance(port, str) else port


def pod_spec(doc: Doc) -> Doc | None:
    if doc["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job"}:
        return doc["spec"]["template"]["spec"]
    return None


K8S_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand_k8s_vars(arg: str, env: dict[str, str]) -> str:
    """Kubernetes expands `$(VAR)` in command and args from the container's env."""
    return K8S_VAR.sub(lambda m: env.get(m.group(1), m.group(0)), arg)


def secret_files(container: Doc, volumes: list[Doc], secrets: dict[str, Doc]) -> dict[str, str]:
    """The files a container sees of the Secrets its volumes mount: path -> content."""
    files: dict[str, str] = {}
    by_name = {v["name"]: v for v in volumes}
    for mount in container.get("volumeMounts", []):
        secret = by_name.get(mount["name"], {}).get("secret")
        if secret is None:
            continue
        data = secrets.get(secret["secretName"], {})
        items = secret.get("items") or [{"key": k, "path": k} for k in data]
        inside = {i["path"]: str(data.get(i["key"], "")) for i in items}
        if sub := mount.get("subPath"):
            if sub in inside:
                files[mount["mountPath"]] = inside[sub]
        else:
            for path, content in inside.items():
                files[f"{mount['mountPath'].rstrip('/')}/{path}"] = content
    return files


def k8s_containers(docs: list[Doc]) -> Iterator[Container]:
    config = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    secrets = {
        d["metadata"]["name"]: d.get("stringData", {}) for d in docs if d["kind"] == "Secret"
    }
    for doc in docs:
        spec = pod_spec(doc)
        if spec is None:
            continue
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            image = c["image"]
            ours = image.split("@")[0].rsplit(":", 1)[0].endswith("ctxcache")
            argv = [*c.get("command", ["ctxcache"] if ours else []), *c.get("args", [])]
            env: dict[str, str] = {}
            for source in c.get("envFrom", []):
                env.update(config[source["configMapRef"]["name"]])
            for var in c.get("env", []):
                if "value" in var:
                    env[var["name"]] = str(var["value"])
                elif ref := var.get("valueFrom", {}).get("secretKeyRef"):
                    env[var["name"]] = secrets.get(ref["name"], {}).get(ref["key"], "")
                elif ref := var.get("valueFrom", {}).get("configMapKeyRef"):
                    env[var["name"]] = str(config[ref["name"]][ref["key"]])
            argv = [expand_k8s_vars(str(a), env) for a in argv]
            probes = [
                (p["httpGet"]["path"], p["httpGet"]["port"])
                for name in ("livenessProbe", "readinessProbe", "startupProbe")
                if "httpGet" in (p := c.get(name, {}))
            ]
            yield Container(
                where=f"{doc['kind']}/{doc['metadata']['name']}/{c['name']}",
                image=image,
                argv=[str(a) for a in argv],
                env=env,
                ports={
                    p.get("name", str(p["containerPort"])): p["containerPort"]
                    for p in c.get("ports", [])
                },
                probes=probes,
                raw=c,
                files=secret_files(c, spec.get("volumes", []), secrets),
            )


# vLLM's own server started from a vLLM image (not `ctxcache vllm`): the stock image, or
# `ctxcache-vllm`, that image with this repository installed for ctxcache's connector
# (components/ctxcache-connector-gpu)
VLLM_IMAGES = ("vllm/vllm-openai", "ctxcache-vllm")


def image_name(ref: str) -> str:
    """An image reference without its tag or digest."""
    name = ref.split("@", 1)[0]
    return name.rsplit(":", 1)[0] if ":" in name.rsplit("/", 1)[-1] else name


def from_vllm_image(c: Container) -> bool:
    return c.ctxcache_command is None and image_name(c.image).endswith(VLLM_IMAGES)


def kv_transfer_config(c: Container) -> Doc:
    """vLLM's `--kv-transfer-config` of this container ({} without one)."""
    return dict(json.loads(flag_value(c.argv, "--kv-transfer-config") or "{}"))


def load_compose() -> Doc:
    return yaml.safe_load(COMPOSE_FILE.read_text())


def interpolate(value: str) -> str:
    """Compose's `${VAR:-default}` with every variable unset: its default."""
    return INTERPOLATION.sub(lambda m: m.group(2) or "", value)


def compose_secret_files(compose: Doc, svc: Doc) -> dict[str, str]:
    """The compose secrets a service mounts (`file:` sources, at /run/secrets/<name>)."""
    files: dict[str, str] = {}
    for entry in svc.get("secrets", []):
        source = entry if isinstance(entry, str) else entry["source"]
        target = source if isinstance(entry, str) else entry.get("target", source)
        path = ROOT / interpolate(str(compose["secrets"][source]["file"]))
        files[target if target.startswith("/") else f"/run/secrets/{target}"] = path.read_text()
    return files


def compose_containers(compose: Doc) -> Iterator[Container]:
    for name, svc in compose["services"].items():
        ours = "build" in svc or "ctxcache" in svc.get("image", "")
        entry = svc.get("entrypoint", ["ctxcache"] if ours else [])
        argv = [interpolate(str(a)) for a in [*entry, *svc.get("command", [])]]
        env = {k: interpolate(str(v)) for k, v in (svc.get("environment") or {}).items()}
        probes: list[tuple[str, int | str]] = []
        test = " ".join(svc.get("healthcheck", {}).get("test", []))
        for m in re.finditer(r"http://(?:127\.0\.0\.1|localhost):(\d+)(/[\w/.-]*)", test):
            probes.append((m.group(2), int(m.group(1))))
        yield Container(
            where=f"compose/{name}",
            image=interpolate(svc.get("image", "")),
            argv=argv,
            env=env,
            probes=probes,
            raw=svc,
            files=compose_secret_files(compose, svc),
        )


def shell_ctxcache_commands(container: Container) -> list[list[str]]:
    """`ctxcache ...` invocations inside `sh -c` scripts (e.g. the model-init step)."""
    if not container.argv or Path(container.argv[0]).name not in {"sh", "bash"}:
        return []
    found = []
    for script in container.argv[1:]:
        for part in re.split(r"&&|\|\||;", script):
            words = shlex.split(part)
            if words and words[0] == "ctxcache":
                found.append(words[1:])
    return found


# ---- facts from the source ------------------------------------------------------------


@cache
def route_table(package: str) -> frozenset[str]:
    """GET paths a FastAPI package serves: `APIRouter(prefix=...)` + `@x.get(path)`.

    Routers are included without a prefix in every app (checked: a prefix passed to
    `include_router` makes this raise, so the table can never be silently wrong).
    """
    paths: set[str] = set()
    for source in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(source.read_text())
        prefixes: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "include_router":
                assert not any(k.arg == "prefix" for k in node.keywords), source
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", "") == "APIRouter"
            ):
                prefix = next((k.value.value for k in node.value.keywords if k.arg == "prefix"), "")
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        prefixes[target.id] = str(prefix)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for dec in node.decorator_list:
                if (
                    isinstance(dec, ast.Call)
                    and isinstance(dec.func, ast.Attribute)
                    and dec.func.attr in {"get", "api_route"}
                    and isinstance(dec.func.value, ast.Name)
                    and dec.args
                    and isinstance(dec.args[0], ast.Constant)
                ):
                    paths.add(prefixes.get(dec.func.value.id, "") + str(dec.args[0].value))
    return frozenset(paths)


def lmcache_config_keys() -> set[str]:
    """The keys of LMCache's `_CONFIG_DEFINITIONS` (env var = `LMCACHE_<KEY upper>`)."""
    dist = importlib.metadata.distribution("lmcache")
    source = Path(str(dist.locate_file("lmcache/v1/config.py")))
    tree = ast.parse(source.read_text())
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.AnnAssign | ast.Assign)
            and isinstance(node.value, ast.Dict)
            and "_CONFIG_DEFINITIONS"
            in [
                getattr(t, "id", "")
                for t in getattr(node, "targets", [getattr(node, "target", None)])
            ]
        ):
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    raise AssertionError(f"_CONFIG_DEFINITIONS not found in {source}")


def lmcache_version() -> str:
    return importlib.metadata.version("lmcache")


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of `--flag V` or `--flag=V` in argv."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1 :]
    return None
