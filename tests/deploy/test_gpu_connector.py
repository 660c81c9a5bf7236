"""The two KV connectors of the GPU overlays (docs/deploy.md, "Which connector on GPU
nodes"): `overlays/gpu` keeps LMCache's; `overlays/gpu-ctxcache` = `overlays/gpu` + the
component `components/ctxcache-connector-gpu` runs vLLM with ctxcache's connector over the
sidecar's shared memory, configured as `ctxcache vllm` configures it on the CPU overlay, and
differs from `overlays/gpu` in nothing but what the component says.

(Schemas, the real-kustomize comparison, /dev/shm, tracing and tool calling of the variant
are checked with every overlay: tests/deploy/manifests.py's OVERLAYS.)
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import json
from typing import Any

from ctxcache.cli import build_parser
from ctxcache.vllm_engine import CONNECTOR_CLASS, CONNECTOR_MODULE, VllmLaunch
from tests.deploy.manifests import (
    ROOT,
    Container,
    Doc,
    find,
    image_name,
    k8s_containers,
    key,
    kv_transfer_config,
    render,
)
from tests.deploy.test_local_kv import (
    memory_mounts,
    pod_errors,
    quantity,
    region_bytes,
    sidecar_local_dir,
)
from vllm_connector.config import ConnectorConfig

VARIANT = "gpu-ctxcache"
# what the component changes in overlays/gpu's worker pod, and nothing else
COMPONENT_ENV = "KV_TRANSFER_CONFIG"
LMCACHE_PREFIX = "LMCACHE_"


def worker(docs: list[Doc]) -> dict[str, Container]:
    """The worker pod's containers by name (ConfigMaps resolved)."""
    settings = [d for d in docs if d["kind"] in {"ConfigMap", "Secret"}]
    sts = find(docs, "StatefulSet", "worker")
    return {c.where.rsplit("/", 1)[1]: c for c in k8s_containers([*settings, sts])}


def test_the_gpu_overlay_keeps_lmcache_as_its_default() -> None:
    containers = worker(render("gpu"))
    vllm, sidecar = containers["worker"], containers["sidecar"]
    assert kv_transfer_config(vllm) == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    assert vllm.env["LMCACHE_REMOTE_URL"] == "lm://localhost:65432"
    assert image_name(vllm.image) == "vllm/vllm-openai"  # the stock image ships LMCache
    assert sidecar_local_dir(sidecar) is None  # LMCache has no shared-memory path


def test_the_variant_configures_the_connector_as_ctxcache_vllm_does() -> None:
    containers = worker(render(VARIANT))
    vllm, sidecar = containers["worker"], containers["sidecar"]
    transfer = kv_transfer_config(vllm)
    assert transfer["kv_connector"] == CONNECTOR_CLASS == "CtxcacheConnector"
    assert transfer["kv_connector_module_path"] == CONNECTOR_MODULE
    extra = ConnectorConfig.from_extra(transfer["kv_connector_extra_config"])  # parses, strict
    # local_dir is the sidecar's --local-dir; sidecar_url its data port in this pod
    assert extra.local_dir == sidecar_local_dir(sidecar) == "/run/ctxcache/kv"
    assert extra.sidecar_url == f"lm://localhost:{sidecar.env['CTX_SIDECAR_PORT']}"

    # the CPU overlay's `ctxcache vllm` builds its config from its flags: the same one
    cpu = worker(render("cpu"))["worker"]
    assert cpu.ctxcache_command == "vllm"
    args = build_parser().parse_args(cpu.argv[1:])
    on_cpu = VllmLaunch(
        model=args.model,
        served_name="m",
        port=args.port,
        sidecar_lm=args.sidecar,
        sidecar_local_dir=args.sidecar_local_dir,
        connector_config={"chunk_size": args.chunk_size, "async_loads": args.async_loads},
    ).transfer_config()  # (as ctxcache/vllm_engine.py's main builds it)
    cpu_extra = on_cpu.pop("kv_connector_extra_config")
    gpu = dict(transfer)
    gpu_extra = gpu.pop("kv_connector_extra_config")
    assert gpu == on_cpu  # connector, module, role, load-failure policy
    assert ConnectorConfig.from_extra(gpu_extra) == ConnectorConfig.from_extra(cpu_extra)

    # the module path names our module, and it defines the class (read, not imported:
    # importing it needs vLLM and torch)
    assert importlib.util.find_spec(CONNECTOR_MODULE) is not None
    source = (ROOT / (CONNECTOR_MODULE.replace(".", "/") + ".py")).read_text()
    classes = {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)}
    assert CONNECTOR_CLASS in classes

    # LMCache is not loaded: its settings are gone; the image is vLLM's + this repository
    assert not [n for n in vllm.env if n.startswith(LMCACHE_PREFIX)]
    assert image_name(vllm.image) == "ghcr.io/ctxcache/ctxcache-vllm"
    assert ":" in vllm.image.rsplit("/", 1)[-1], "the overlay names a tag"


def test_both_containers_map_one_memory_volume_that_holds_the_region() -> None:
    docs = render(VARIANT)
    sts = find(docs, "StatefulSet", "worker")
    pod = sts["spec"]["template"]["spec"]
    containers = worker(docs)
    vllm, sidecar = containers["worker"], containers["sidecar"]
    local = sidecar_local_dir(sidecar)
    assert local is not None
    parent = local.rsplit("/", 1)[0]
    # the same memory-backed volume at the local dir's parent in both containers
    assert memory_mounts(pod, vllm.raw).get(parent) == "kv-local"
    assert memory_mounts(pod, sidecar.raw).get(parent) == "kv-local"
    volume = next(v for v in pod["volumes"] if v["name"] == "kv-local")["emptyDir"]
    assert volume["medium"] == "Memory"
    region = region_bytes(sidecar)
    assert region > 72 << 30  # 64 GiB memory tier x 1.125, and the header
    assert quantity(volume["sizeLimit"]) >= region
    # the region is charged to the sidecar that reserves it: its limit holds it and more
    assert quantity(sidecar.raw["resources"]["limits"]["memory"]) >= region + (4 << 30)
    # vLLM's own shared memory (its queues, NCCL) is another, bounded memory volume
    assert {m["mountPath"]: m["name"] for m in vllm.raw["volumeMounts"]}["/dev/shm"] == "dshm"
    # the sidecar's 0660 files are group 10001's; vLLM (root in its image) gets the group
    assert pod["securityContext"]["fsGroup"] == 10001
    assert pod_errors(docs, sts, ours=True) == []


def _without_the_component(pod: Doc) -> Doc:
    """The worker pod with every field the component sets taken out."""
    pod = copy.deepcopy(pod)
    for c in pod["containers"]:
        if c["name"] == "worker":
            c.pop("image")
            c["env"] = sorted(
                (
                    e
                    for e in c["env"]
                    if e["name"] != COMPONENT_ENV and not e["name"].startswith(LMCACHE_PREFIX)
                ),
                key=lambda e: str(e["name"]),
            )
        if c["name"] == "sidecar":
            c.pop("args")
            for part in ("requests", "limits"):
                c["resources"][part].pop("memory")
    return pod


def test_the_variant_differs_from_the_gpu_overlay_only_where_the_component_says() -> None:
    gpu = {key(d): d for d in render("gpu")}
    variant = {key(d): d for d in render(VARIANT)}
    assert sorted(gpu) == sorted(variant)
    differ = [k for k in gpu if gpu[k] != variant[k]]
    assert [k[1:] for k in differ] == [("StatefulSet", "ctxcache", "worker")]
    (k,) = differ
    assert {**gpu[k], "spec": None} == {**variant[k], "spec": None}
    gpu_spec, variant_spec = gpu[k]["spec"], variant[k]["spec"]
    assert {**gpu_spec, "template": None} == {**variant_spec, "template": None}
    gpu_pod, variant_pod = gpu_spec["template"]["spec"], variant_spec["template"]["spec"]
    assert _without_the_component(gpu_pod) == _without_the_component(variant_pod)
    # and what it does change, it changes
    assert gpu_pod != variant_pod
    # the check itself: a field the component does not own, changed, is a difference
    moved = copy.deepcopy(variant_pod)
    moved["containers"][0]["resources"]["limits"]["memory"] = "1Gi"
    assert _without_the_component(gpu_pod) != _without_the_component(moved)


def _with_transfer(docs: list[Doc], change: Any) -> Doc:
    sts = copy.deepcopy(find(docs, "StatefulSet", "worker"))
    vllm = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "worker")
    var = next(e for e in vllm["env"] if e["name"] == COMPONENT_ENV)
    transfer = json.loads(var["value"])
    change(transfer)
    var["value"] = json.dumps(transfer)
    return sts


def test_the_checks_catch_a_connector_pointed_elsewhere() -> None:
    docs = render(VARIANT)

    def elsewhere(t: Doc) -> None:
        t["kv_connector_extra_config"]["local_dir"] = "/dev/shm/kv"

    def no_local_dir(t: Doc) -> None:
        del t["kv_connector_extra_config"]["local_dir"]

    assert "/dev/shm/kv" in " ".join(pod_errors(docs, _with_transfer(docs, elsewhere), ours=True))
    errors = pod_errors(docs, _with_transfer(docs, no_local_dir), ours=True)
    assert "only some containers" in " ".join(errors)
