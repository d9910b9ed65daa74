"""What ships, checked without building anything: every package of the tree is one pyproject.toml
lists (so the wheel has it), the Dockerfile copies every one of them into the image, and the
Kubernetes manifests of deploy/ are valid objects (kubernetes-validate's schemas, offline) that
run the image the Dockerfile builds.  (The image built and run: tests/image/.)"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGES: list[str] = PYPROJECT["tool"]["setuptools"]["packages"]
VERSION: str = PYPROJECT["project"]["version"]
#: The Kubernetes version the manifests are checked against (kubernetes-validate's schemas).
KUBERNETES = "1.32"


def _copied(dockerfile: str) -> set[str]:
    """The tree's paths a Dockerfile copies into the image (``COPY SRC... DEST``)."""
    out: set[str] = set()
    for line in dockerfile.splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            out |= {w.rstrip("/") for w in words[1:-1] if not w.startswith("--")}
    return out


def _missing_from_image(dockerfile: str) -> list[str]:
    copied = _copied(dockerfile)
    return [p for p in PACKAGES if "." not in copied and p.split(".")[0] not in copied]


def test_every_package_of_the_tree_is_listed_for_the_wheel() -> None:
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in {p.split(".")[0] for p in PACKAGES}
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert found == set(PACKAGES), "pyproject.toml's [tool.setuptools] packages and the tree differ"


def test_the_dockerfile_copies_every_listed_package() -> None:
    assert _missing_from_image((ROOT / "Dockerfile").read_text()) == []
    # (the check itself: a Dockerfile that leaves one out is caught)
    without = re.sub(r"^COPY tpagent_rank tpagent_rank$", "", (ROOT / "Dockerfile").read_text(), flags=re.MULTILINE)
    assert _missing_from_image(without) == ["tpagent_rank"]


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec", {})
    spec = spec.get("template", {}).get("spec", spec)
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


@pytest.mark.parametrize("path", sorted((ROOT / "deploy").glob("*.yaml")), ids=lambda p: p.name)
def test_a_manifest_is_valid_and_runs_the_image_this_tree_builds(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs
    images = []
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        images += [c["image"] for c in _containers(doc) if c["image"].split(":")[0].endswith("tpagent")]
    assert images and set(images) == {f"tpagent:{VERSION}"}, images
