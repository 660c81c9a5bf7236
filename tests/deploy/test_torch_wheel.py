"""The image build takes torch as a wheel file (air-gapped: no torch index): the builder's
installer (deploy/install-torch.sh, as deploy/Dockerfile runs it) with real pip, a torch
wheel of the pinned version in the folder and no index answering."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from ctxcache.net import free_port
from tests.deploy.manifests import DOCKERFILE, ROOT

SCRIPT = ROOT / "deploy" / "install-torch.sh"
VERSION = "2.13.0+cpu"


def fake_torch_wheel(folder: Path, version: str) -> Path:
    """A tiny pure-Python wheel named like PyTorch's, importable as `torch`."""
    info = f"torch-{version}.dist-info"
    files = {
        "torch/__init__.py": f'__version__ = "{version}"\n',
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    path = folder / f"torch-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in {**files, f"{info}/RECORD": record}.items():
            z.writestr(name, text)
    return path


def install(wheels: Path, target: Path) -> subprocess.CompletedProcess[str]:
    nowhere = f"http://127.0.0.1:{free_port()}/"  # no index answers
    env = {
        # this machine's own pip settings (its find-links, extra indexes) are not the build's
        **{k: v for k, v in os.environ.items() if not k.startswith("PIP_")},
        "PIP_CONFIG_FILE": os.devnull,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # pip
        "WHEELS": str(wheels),
        "PIP_INDEX_URL": nowhere,
        "TORCH_INDEX_URL": nowhere + "torch/",
        "PIP_TARGET": str(target),  # not this environment
        "PIP_RETRIES": "0",
        "PIP_NO_CACHE_DIR": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    return subprocess.run(
        ["sh", str(SCRIPT), VERSION], env=env, capture_output=True, text=True, timeout=120
    )


def test_torch_comes_from_its_wheel_file_without_any_index(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fake_torch_wheel(wheels, VERSION)
    out = install(wheels, tmp_path / "site")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "torch" / "__init__.py").read_text() == (
        f'__version__ = "{VERSION}"\n'
    )


def test_without_the_wheel_torch_comes_from_the_torch_index(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    fake_torch_wheel(wheels, "2.12.0+cpu")  # not the pinned version: not used
    out = install(wheels, tmp_path / "site")
    assert out.returncode != 0  # the torch index is asked, and here nothing answers
    assert "/torch/" in out.stdout + out.stderr
    assert not (tmp_path / "site" / "torch").exists()


def test_the_dockerfile_installs_torch_with_it_and_the_version_pinned() -> None:
    text = DOCKERFILE.read_text()
    assert "COPY deploy/wheels/ /wheels/" in text
    assert f"install-torch.sh {VERSION}" in text
    assert f"torch=={VERSION.split('+')[0]}" in (ROOT / "constraints.txt").read_text()
    ignored = (ROOT / ".dockerignore").read_text().split()
    # the build context carries the folder and the script, though deploy/ is left out
    assert ignored.index("!deploy/wheels") > ignored.index("deploy")
    assert ignored.index("!deploy/install-torch.sh") > ignored.index("deploy")
    assert (ROOT / "deploy" / "wheels").is_dir()  # COPY needs it, empty or not
