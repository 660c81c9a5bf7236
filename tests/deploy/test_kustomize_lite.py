"""The minimal renderer: its strategic merge, and the same output as a real kustomize."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy import kustomize_lite
from tests.deploy.manifests import K8S, OVERLAYS, key, real_kustomize, render, render_real


def test_containers_merge_by_name_and_other_lists_are_replaced() -> None:
    base = {
        "containers": [{"name": "a", "args": ["x", "y"], "env": [{"name": "A", "value": "1"}]}],
        "tolerations": [{"key": "k1"}],
        "nodeSelector": {"keep": "me", "drop": "me"},
    }
    patch = {
        "containers": [
            {"name": "a", "args": ["z"], "env": [{"name": "B", "value": "2"}]},
            {"name": "b", "image": "i"},
        ],
        "tolerations": [{"key": "k2"}],
        "nodeSelector": {"drop": None},
    }
    merged = kustomize_lite.strategic_merge(base, patch)
    assert merged["containers"] == [
        {
            "name": "a",
            "args": ["z"],
            "env": [{"name": "B", "value": "2"}, {"name": "A", "value": "1"}],
        },
        {"name": "b", "image": "i"},
    ]
    assert merged["tolerations"] == [{"key": "k2"}]
    assert merged["nodeSelector"] == {"keep": "me"}
    assert base["containers"][0]["args"] == ["x", "y"], "inputs are not modified"


def test_a_delete_directive_takes_the_base_item_away() -> None:
    base = {"env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]}
    patch = {"env": [{"name": "C", "value": "3"}, {"name": "A", "$patch": "delete"}]}
    assert kustomize_lite.strategic_merge(base, patch) == {
        "env": [{"name": "C", "value": "3"}, {"name": "B", "value": "2"}]
    }
    for directive in ({"name": "A", "$patch": "replace"}, {"$patch": "delete", "x": 1}):
        with pytest.raises(kustomize_lite.Unsupported):
            kustomize_lite.strategic_merge({"env": base["env"], "x": {}}, {"env": [directive]})


def _write(directory: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text)


CONFIG = "apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: {name}}}\ndata: {{k: {value}}}\n"


def test_a_component_patches_what_its_overlay_has_accumulated(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "base/kustomization.yaml": "resources: [cm.yaml]\n",
            "base/cm.yaml": CONFIG.format(name="a", value="base"),
            "comp/kustomization.yaml": (
                "apiVersion: kustomize.config.k8s.io/v1alpha1\nkind: Component\n"
                "resources: [extra.yaml]\npatches: [{path: p.yaml}]\n"
            ),
            "comp/extra.yaml": CONFIG.format(name="b", value="comp"),
            "comp/p.yaml": CONFIG.format(name="a", value="component"),
            "ovl/kustomization.yaml": (
                "resources: [../base]\ncomponents: [../comp]\npatches: [{path: p.yaml}]\n"
            ),
            # the overlay's own patches run after its components
            "ovl/p.yaml": CONFIG.format(name="b", value="overlay"),
        },
    )
    docs = kustomize_lite.render(tmp_path / "ovl")
    assert {d["metadata"]["name"]: d["data"]["k"] for d in docs} == {
        "a": "component",
        "b": "overlay",
    }
    # a component is no resource, and cannot be built alone
    _write(tmp_path, {"bad/kustomization.yaml": "resources: [../comp]\n"})
    with pytest.raises(ValueError, match="Component"):
        kustomize_lite.render(tmp_path / "bad")
    with pytest.raises(ValueError, match="Component"):
        kustomize_lite.render(tmp_path / "comp")


def test_an_unsupported_kustomize_feature_is_refused(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("namePrefix: dev-\nresources: []\n")
    with pytest.raises(kustomize_lite.Unsupported):
        kustomize_lite.render(tmp_path)


def test_overlays_set_namespace_and_images() -> None:
    for overlay in OVERLAYS:
        docs = render(overlay)
        assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {
            "ctxcache"
        }
        pods = [d["spec"]["template"]["spec"] for d in docs if "template" in d.get("spec", {})]
        images = {
            c["image"] for p in pods for c in [*p["containers"], *p.get("initContainers", [])]
        }
        assert "ctxcache" not in images, "every ctxcache container gets the overlay's image"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_same_output_as_a_real_kustomize(overlay: str) -> None:
    command = real_kustomize()
    if command is None:
        pytest.skip("no kustomize or kubectl on this machine: the minimal renderer is used alone")
    real = {key(d): d for d in render_real(K8S / "overlays" / overlay, command)}
    lite = {key(d): d for d in render(overlay)}
    assert sorted(lite) == sorted(real)
    for k, doc in real.items():
        assert lite[k] == doc, k
