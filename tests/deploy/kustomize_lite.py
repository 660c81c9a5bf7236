"""A minimal kustomize renderer for exactly the features `deploy/k8s/` uses.

Used when no real kustomize is on the machine (`kustomize build` or `kubectl kustomize`);
where one is, `test_kustomize_lite.py` checks that both render the overlays identically.

Supported (anything else in a kustomization.yaml raises `Unsupported`):
- `resources`: files (multi-document YAML) and directories holding a kustomization.yaml;
- `components`: directories holding a `kind: Component` kustomization.yaml, applied after
  the resources to everything accumulated so far (their own resources added, their
  patches and images run over the whole), as kustomize does;
- `patches` with `path`: strategic-merge patches matched by kind + metadata.name; lists
  of containers, initContainers, volumes, env, imagePullSecrets merge by `name`,
  volumeMounts by `mountPath`, container ports by `containerPort` (result order as
  kustomize's: the patch's items, then the base's other items), an item of such a list
  with `$patch: delete` removes the base's item of its key, other lists and scalars are
  replaced, a null value deletes the key (no other `$patch` directive);
- `images`: `name` -> `newName` / `newTag` / `digest` on containers and initContainers;
- `namespace`: set on every namespaced object;
- `configMapGenerator` with `name`, `files` (`PATH` or `KEY=PATH`) and `options.labels`,
  under `generatorOptions` with `disableNameSuffixHash: true` (and optional `labels`).
No hashed generator names, other generators, name prefixes/suffixes, labels, replacements
or JSON 6902 patches.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Doc = dict[str, Any]

SUPPORTED_KEYS = {
    "apiVersion",
    "kind",
    "resources",
    "components",
    "patches",
    "images",
    "namespace",
    "configMapGenerator",
    "generatorOptions",
}
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
}
# list field -> the key its items merge on (strategic merge patch, core/v1 + apps/v1)
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "imagePullSecrets": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
}


class Unsupported(ValueError):
    """A kustomization uses a feature this renderer does not implement."""


def load_yaml_docs(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def render(directory: Path) -> list[Doc]:
    """`kustomize build DIRECTORY`, for the supported subset."""
    return _build(directory, [], component=False)


def _build(directory: Path, docs: list[Doc], *, component: bool) -> list[Doc]:
    """A Kustomization (from nothing) or a Component (over `docs`, its parent's so far)."""
    kfile = directory / "kustomization.yaml"
    spec = yaml.safe_load(kfile.read_text()) or {}
    unknown = set(spec) - SUPPORTED_KEYS
    if unknown:
        raise Unsupported(f"{kfile}: unsupported kustomization fields {sorted(unknown)}")
    kind = spec.get("kind", "Kustomization")
    if kind != ("Component" if component else "Kustomization"):
        where = "components" if component else "resources or built directly"
        raise ValueError(f"{kfile}: a {kind} cannot be in {where}")
    docs = list(docs)
    for entry in spec.get("resources", []):
        path = directory / entry
        docs.extend(render(path) if path.is_dir() else load_yaml_docs(path))
    for entry in spec.get("components", []):
        docs = _build(directory / entry, docs, component=True)
    docs.extend(_generated(directory, spec))
    for patch in spec.get("patches", []):
        if set(patch) != {"path"}:
            raise Unsupported(f"{kfile}: only `patches: [{{path: ...}}]` is supported")
        for p in load_yaml_docs(directory / patch["path"]):
            target = _find(docs, p["kind"], p["metadata"]["name"])
            merged = strategic_merge(target, p)
            docs[docs.index(target)] = merged
    for image in spec.get("images", []):
        for doc in docs:
            _set_image(doc, image)
    if "namespace" in spec:
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc.setdefault("metadata", {})["namespace"] = spec["namespace"]
    return docs


def _generated(directory: Path, spec: dict[str, Any]) -> list[Doc]:
    """The ConfigMaps of `configMapGenerator` (names without a hash suffix only)."""
    generators = spec.get("configMapGenerator", [])
    if not generators:
        return []
    options = spec.get("generatorOptions") or {}
    if options.get("disableNameSuffixHash") is not True or set(options) - {
        "disableNameSuffixHash",
        "labels",
    }:
        raise Unsupported("only generatorOptions {disableNameSuffixHash: true, labels}")
    out: list[Doc] = []
    for gen in generators:
        if set(gen) - {"name", "files", "options"} or set(gen.get("options", {})) - {"labels"}:
            raise Unsupported(f"configMapGenerator {gen.get('name')}: name/files/labels only")
        data: dict[str, str] = {}
        for entry in gen.get("files", []):
            key, _, path = entry.rpartition("=") if "=" in entry else ("", "", entry)
            data[key or Path(path).name] = (directory / path).read_text()
        labels = {**options.get("labels", {}), **gen.get("options", {}).get("labels", {})}
        metadata: dict[str, Any] = {"name": gen["name"]}
        if labels:
            metadata["labels"] = labels
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data})
    return out


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """`patch` applied to `base` (neither is modified)."""
    if isinstance(patch, dict) and "$patch" in patch:
        raise Unsupported(f"`$patch: {patch['$patch']}` outside a list item to delete")
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        if all(isinstance(i, dict) and key in i for i in [*base, *patch]):
            # kustomize's (kyaml) order: the patch's items first, then the base's others;
            # `$patch: delete` items take the base's item of their key away
            by_key = {b[key]: b for b in base}
            deleted = {i[key] for i in patch if _deletes(i)}
            out = [
                strategic_merge(by_key[i[key]], i) if i[key] in by_key else copy.deepcopy(i)
                for i in patch
                if i[key] not in deleted
            ]
            patched = {i[key] for i in patch}
            return out + [copy.deepcopy(b) for b in base if b[key] not in patched]
    if isinstance(patch, list) and any(isinstance(i, dict) and "$patch" in i for i in patch):
        raise Unsupported(f"{field}: `$patch` in a list that does not merge by a key")
    return copy.deepcopy(patch)


def _deletes(item: Doc) -> bool:
    """A list item `{<key>: ..., $patch: delete}`; any other directive is refused."""
    directive = item.get("$patch")
    if directive is None:
        return False
    if directive != "delete" or len(item) != 2:
        raise Unsupported(f"list item {item}: only `$patch: delete` with its merge key")
    return True


def _find(docs: list[Doc], kind: str, name: str) -> Doc:
    for doc in docs:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise KeyError(f"patch target {kind}/{name} not found")


def _set_image(doc: Doc, image: dict[str, str]) -> None:
    pod = doc.get("spec", {}).get("template", {}).get("spec", {})
    for container in [*pod.get("containers", []), *pod.get("initContainers", [])]:
        ref = container.get("image", "")
        name = ref.split("@", 1)[0]
        if ":" in name.rsplit("/", 1)[-1]:
            name = name.rsplit(":", 1)[0]
        if name != image["name"]:
            continue
        new = image.get("newName", name)
        if "digest" in image:
            container["image"] = f"{new}@{image['digest']}"
        elif "newTag" in image:
            container["image"] = f"{new}:{image['newTag']}"
        else:
            container["image"] = new + ref[len(name) :]
