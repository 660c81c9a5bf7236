"""The shared-memory KV path in the deployment files (docs/deploy.md, "Shared-memory KV
path"): wherever an engine and its sidecar share a pod, one memory-backed volume is
mounted in both at one path; the directory the sidecar is told (`--local-dir`) and the one
the engine is told (`--sidecar-local-dir`, or the connector's `local_dir`) are that path;
the volume holds the region the sidecar reserves there; compose shares one tmpfs volume
between the sidecar and the cpu engine the same way.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest

from sidecar.settings import SidecarSettings
from tests.deploy.manifests import (
    DOCKERFILE,
    OVERLAYS,
    Container,
    Doc,
    compose_containers,
    find,
    flag_value,
    interpolate,
    k8s_containers,
    load_compose,
    pod_spec,
    render,
)

QUANTITY = re.compile(r"(\d+)([KMGT]i?|[kmgt])?")
SCALE = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
SCALE |= {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
SCALE |= {"m": 1 << 20, "g": 1 << 30, "t": 1 << 40}  # tmpfs's size= (k: 1024 as well)


def quantity(text: str, tmpfs: bool = False) -> int:
    """A Kubernetes quantity (`5Gi`, `5632Mi`), or with `tmpfs` a tmpfs `size=` (`5g`)."""
    m = QUANTITY.fullmatch(str(text))
    assert m, f"not a size: {text!r}"
    unit = m.group(2) or ""
    return int(m.group(1)) * (1 << 10 if tmpfs and unit == "k" else SCALE[unit])


def is_engine(c: Container) -> bool:
    return c.ctxcache_command in {"worker", "vllm"} or "vllm" in c.image or c.argv[:1] == ["vllm"]


def sidecar_local_dir(c: Container) -> str | None:
    return flag_value(c.argv, "--local-dir") or c.env.get("CTX_SIDECAR_LOCAL_DIR")


def engine_local_dir(c: Container) -> str | None:
    """`--sidecar-local-dir` (both ctxcache engines), the built-in worker's variable, or
    `local_dir` in the ctxcache connector's extra config (vLLM started any other way)."""
    if given := flag_value(c.argv, "--sidecar-local-dir"):
        return given
    if c.ctxcache_command == "worker" and (given := c.env.get("CTX_WORKER_SIDECAR_LOCAL_DIR")):
        return given
    transfer = json.loads(flag_value(c.argv, "--kv-transfer-config") or "{}")
    local = transfer.get("kv_connector_extra_config", {}).get("local_dir")
    return str(local) if local else None


def region_bytes(c: Container) -> int:
    """What the sidecar reserves in its local dir: its --local-bytes, else memory x 1.125,
    and a little (the region's header page, the socket)."""
    memory = flag_value(c.argv, "--memory-bytes") or c.env.get("CTX_SIDECAR_MEMORY_BYTES")
    local = flag_value(c.argv, "--local-bytes") or c.env.get("CTX_SIDECAR_LOCAL_BYTES")
    settings = SidecarSettings(
        **({"memory_bytes": int(memory)} if memory else {}),
        local_bytes=int(local) if local else None,
    )
    return settings.region_bytes + (1 << 20)


def memory_mounts(pod: Doc, container: Doc) -> dict[str, str]:
    """mountPath -> volume name of this container's memory-backed emptyDirs, /dev/shm aside."""
    memory = {
        v["name"]
        for v in pod.get("volumes", [])
        if (v.get("emptyDir") or {}).get("medium") == "Memory"
    }
    return {
        m["mountPath"]: m["name"]
        for m in container.get("volumeMounts", [])
        if m["name"] in memory and m["mountPath"] != "/dev/shm"
    }


def engines_and_sidecars(docs: list[Doc], doc: Doc) -> tuple[list[Container], list[Container]]:
    settings = [d for d in docs if d["kind"] in {"ConfigMap", "Secret"}]
    containers = list(k8s_containers([*settings, doc]))
    engines = [c for c in containers if is_engine(c)]
    return engines, [c for c in containers if c.ctxcache_command == "sidecar"]


def pod_errors(docs: list[Doc], doc: Doc, *, ours: bool) -> list[str]:
    """What is wrong with the shared-memory path of one workload; `ours`: its engine is
    ctxcache's (the path must be on), else (LMCache) the volume is there, the path off."""
    spec = pod_spec(doc)
    assert spec is not None
    engines, sidecars = engines_and_sidecars(docs, doc)
    if not engines or not sidecars:
        return []
    where = f"{doc['kind']}/{doc['metadata']['name']}"
    errors: list[str] = []
    shared = set.intersection(
        *(set(memory_mounts(spec, c.raw).items()) for c in [*engines, *sidecars])
    )
    if len(shared) != 1:
        return [f"{where}: not one memory-backed volume at one path in every container"]
    path, name = shared.pop()
    volume = next(v for v in spec["volumes"] if v["name"] == name)["emptyDir"]
    if "sizeLimit" not in volume:
        errors.append(f"{where}: {name} has no sizeLimit")
    told = {c.where: sidecar_local_dir(c) for c in sidecars}
    told |= {c.where: engine_local_dir(c) for c in engines}
    # a subdirectory of the volume: an emptyDir is 0777, which the sidecar refuses
    want = f"{path}/kv"
    for who, given in told.items():
        if given not in ({want} if ours else {want, None}):
            errors.append(f"{who}: local dir {given!r}, want {want} (the shared volume's kv/)")
    if len({given is None for given in told.values()}) > 1:
        errors.append(f"{where}: only some containers use the local dir: {told}")
    for c in sidecars:
        if sidecar_local_dir(c) is None:
            continue
        region = region_bytes(c)
        if "sizeLimit" in volume and quantity(volume["sizeLimit"]) < region:
            errors.append(f"{where}: {name} holds less than the {region}-byte region")
        limit = c.raw.get("resources", {}).get("limits", {}).get("memory")
        if limit is None or quantity(limit) < region + (512 << 20):
            errors.append(f"{c.where}: memory limit {limit} below the region + 512 MiB")
    return errors


def worker_pod(docs: list[Doc]) -> Doc:
    return find(docs, "StatefulSet", "worker")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engine_and_sidecar_share_one_memory_volume_and_agree_on_its_path(overlay: str) -> None:
    docs = render(overlay)
    pods = [d for d in docs if pod_spec(d) is not None and all(engines_and_sidecars(docs, d))]
    assert pods == [worker_pod(docs)], f"{overlay}: engine + sidecar pods"
    for doc in docs:
        if pod_spec(doc) is not None:
            assert pod_errors(docs, doc, ours=overlay != "gpu") == [], overlay
    # 0660 files of the sidecar (uid 10001): the engine runs as that uid, or has its group
    security = pod_spec(worker_pod(docs))["securityContext"]  # type: ignore[index]
    assert security["fsGroup"] == 10001, overlay


def test_the_cpu_engine_uses_the_shared_memory_path_with_either_engine() -> None:
    docs = render("cpu")
    containers = {c.where.rsplit("/", 1)[1]: c for c in k8s_containers(docs)}
    assert sidecar_local_dir(containers["sidecar"]) == "/run/ctxcache/kv"
    assert engine_local_dir(containers["worker"]) == "/run/ctxcache/kv"
    assert containers["worker"].ctxcache_command == "vllm"
    # the built-in worker (the worker-engine ConfigMap's other choice) takes the same flag
    builtin = copy.deepcopy(containers["worker"])
    builtin.argv[1] = "worker"
    assert engine_local_dir(builtin) == "/run/ctxcache/kv"


def test_the_check_catches_a_wrong_path_a_missing_mount_or_a_disk_volume() -> None:
    docs = render("cpu")
    sts = worker_pod(docs)
    assert pod_errors(docs, sts, ours=True) == []

    def broken(change: Any) -> list[str]:
        doc = copy.deepcopy(sts)
        change(doc["spec"]["template"]["spec"])
        return pod_errors(docs, doc, ours=True)

    def container(spec: Doc, name: str) -> Doc:
        return next(c for c in spec["containers"] if c["name"] == name)

    def other_path(spec: Doc) -> None:
        args = container(spec, "worker")["args"]
        args[args.index("--sidecar-local-dir") + 1] = "/run/elsewhere"

    def no_engine_flag(spec: Doc) -> None:
        args = container(spec, "worker")["args"]
        del args[args.index("--sidecar-local-dir") : args.index("--sidecar-local-dir") + 2]

    def unmounted(spec: Doc) -> None:
        sidecar = container(spec, "sidecar")
        sidecar["volumeMounts"] = [m for m in sidecar["volumeMounts"] if m["name"] != "kv-local"]

    def kv_local(spec: Doc) -> Doc:
        return next(v for v in spec["volumes"] if v["name"] == "kv-local")

    def on_disk(spec: Doc) -> None:
        kv_local(spec)["emptyDir"] = {}

    def too_small(spec: Doc) -> None:
        kv_local(spec)["emptyDir"]["sizeLimit"] = "4Gi"  # the region is 4.5 GiB

    def tight_limit(spec: Doc) -> None:
        container(spec, "sidecar")["resources"]["limits"]["memory"] = "4608Mi"

    assert "/run/elsewhere" in broken(other_path)[0]
    assert "only some containers" in " ".join(broken(no_engine_flag))
    assert "not one memory-backed volume" in broken(unmounted)[0]
    assert "not one memory-backed volume" in broken(on_disk)[0]
    assert "less than the" in broken(too_small)[0]
    assert "memory limit" in broken(tight_limit)[0]
    # with LMCache the volume may sit unused, but the engine needs ctxcache's connector
    # for it, so a local dir on one side alone is still an error
    assert pod_errors(docs, sts, ours=False) == []
    lmcache = copy.deepcopy(sts)
    no_engine_flag(lmcache["spec"]["template"]["spec"])
    assert "only some containers" in " ".join(pod_errors(docs, lmcache, ours=False))


def tmpfs_options(volume: Doc) -> dict[str, str]:
    opts = volume["driver_opts"]
    assert (opts["type"], opts["device"]) == ("tmpfs", "tmpfs")
    pairs = (o.partition("=") for o in interpolate(str(opts["o"])).split(","))
    return {k: v for k, _, v in pairs}


def test_compose_sidecar_and_cpu_engine_share_one_tmpfs_volume() -> None:
    """One named volume of the local driver with tmpfs options is one tmpfs, mounted in
    both containers (a service's own `tmpfs:` or /dev/shm would be private to it)."""
    compose = load_compose()
    services = compose["services"]
    containers = {c.where.removeprefix("compose/"): c for c in compose_containers(compose)}
    sidecar, worker = containers["sidecar"], containers["worker"]
    path = sidecar_local_dir(sidecar)
    assert path and engine_local_dir(worker) == path
    assert "--sidecar-local-dir" in worker.argv  # a flag both engines take

    def volume_at(service: str) -> str:
        names = [
            v.split(":")[0]
            for v in services[service]["volumes"]
            if v.split(":")[1] == path and not v.endswith(":ro")
        ]
        assert len(names) == 1, f"{service}: nothing mounted at {path}"
        return names[0]

    name = volume_at("sidecar")
    assert volume_at("worker") == name
    options = tmpfs_options(compose["volumes"][name])
    assert quantity(options["size"], tmpfs=True) >= region_bytes(sidecar)
    # the image's user owns it, and only that user and group may enter
    uid = re.search(r"^ARG UID=(\d+)$", DOCKERFILE.read_text(), re.M)
    assert uid and options["uid"] == options["gid"] == uid.group(1)
    assert int(options["mode"], 8) & 0o007 == 0
    # the gpu profile's vLLM runs LMCache: it is given no local dir (yet)
    assert engine_local_dir(containers["vllm"]) is None
