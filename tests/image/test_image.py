"""The container image, built as a user builds it (``scripts/image.sh``: buildah on a base made
with debootstrap, no Docker engine) from this tree's Dockerfile, then run in its root (pivoted
to, in a mount namespace of its own) with the node's /proc, /dev and /sys, as the README runs it
(``--privileged --pid=host``).
Inside it (tests/image/in_image.py): ``tpagent --version`` and ``doctor``, every package
pyproject.toml lists, a rank's stand-in with the image's agent, and a dump and restore of a
workload with the image's own tpagent and CRIU.  (What the Dockerfile copies, and the deploy/
manifests, are checked without building: tests/unit/test_packaging.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.agents import free_port
from support.certs import node_certs
from support.helpers import ROOT

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="building and entering the image needs root"),
    pytest.mark.timeout(1800),  # (the first test builds the image: on a fresh machine, its base too)
]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGES: list[str] = PYPROJECT["tool"]["setuptools"]["packages"]
VERSION: str = PYPROJECT["project"]["version"]
#: Run a command in the image's root ($0) as a container runtime would (its own mount namespace,
#: the root pivoted there: CRIU wants a task's root to be its mount namespace's), with the node's
#: /proc, /dev and /sys (``--privileged --pid=host``), a /run and /tmp of its own, the image's PATH.
CHROOT = (
    'set -e; r=$0; mount --bind "$r" "$r"; '
    'mount --rbind /proc "$r/proc"; mount --rbind /dev "$r/dev"; mount --rbind /sys "$r/sys"; '
    'mount -t tmpfs tmpfs "$r/run"; mount -t tmpfs tmpfs "$r/tmp"; mkdir -p "$r/.host"; '
    'cd "$r"; pivot_root . .host; cd /; umount -l /.host; '
    'exec /usr/bin/env PATH=/opt/tpagent/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "$@"'
)


@pytest.fixture(scope="module")
def image() -> str:
    built = subprocess.run(["bash", str(ROOT / "scripts" / "image.sh")], capture_output=True, text=True, timeout=1800)
    assert built.returncode == 0, built.stderr[-5000:]
    return built.stdout.split()[-1]


@pytest.fixture(scope="module")
def seen(image: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """What tests/image/in_image.py saw, run in a fresh container of the image."""
    ctr = subprocess.run(["buildah", "from", image], capture_output=True, text=True, check=True).stdout.strip()
    try:
        root = Path(
            subprocess.run(["buildah", "mount", ctr], capture_output=True, text=True, check=True).stdout.strip()
        )
        etc = root / "etc" / "tpagent"
        etc.mkdir(mode=0o700, exist_ok=True)
        (etc / "secret").write_text(os.urandom(24).hex())
        (etc / "secret").chmod(0o600)
        shutil.copytree(node_certs(tmp_path_factory.mktemp("image-certs"), "image"), etc / "tls")
        check = root / "opt" / "tpagent-check"
        check.mkdir()
        shutil.copy(Path(__file__).parent / "in_image.py", check)
        cmd = ["/opt/tpagent/venv/bin/python", "/opt/tpagent-check/in_image.py", str(free_port()), *PACKAGES]
        ran = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", CHROOT, str(root), *cmd],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-5000:]
        yield json.loads(ran.stdout.splitlines()[-1])
    finally:
        subprocess.run(["buildah", "rm", ctr], capture_output=True, timeout=120)


def test_the_images_tpagent_says_its_version_and_its_doctor_finds_criu(seen: dict[str, Any]) -> None:
    assert seen["version"] == f"tpagent {VERSION}"
    verdicts = {c["name"]: (c["verdict"], c["message"]) for c in seen["doctor"]["checks"]}
    assert verdicts["criu"][0] == "OK" and "CRIU 4." in verdicts["criu"][1], verdicts["criu"]
    assert verdicts["criu check"][0] == "OK" and verdicts["unshare"][0] == "OK", verdicts


def test_every_package_pyproject_lists_is_installed_in_the_image(seen: dict[str, Any]) -> None:
    assert set(seen["packages"]) == set(PACKAGES)
    for package, where in seen["packages"].items():
        assert where.startswith("/opt/tpagent/venv/lib/"), f"{package} is not the installed one: {where}"


def test_a_rank_started_through_the_images_stand_in_finds_the_runtime_and_its_agent(seen: dict[str, Any]) -> None:
    rank = seen["rank"]
    assert rank["status"] == 7, rank  # (the rank's own status, through its stand-in)
    assert rank["runtime"].startswith("/run/tpagent/") and rank["runtime"].endswith("tpagent_rank/__init__.py"), rank
    assert "does not know rank" not in rank["said"], rank["said"]  # (the agent registered it)


def test_a_workload_is_dumped_and_restored_by_the_images_tpagent_and_criu(seen: dict[str, Any]) -> None:
    counts = seen["counts"]
    frozen, after = counts.get("frozen"), counts.get("after")
    assert frozen and after, counts
    assert frozen == list(range(1, len(frozen) + 1))
    assert after == list(range(len(frozen) + 1, len(frozen) + 1 + len(after)))  # (on from there: none lost, none twice)
