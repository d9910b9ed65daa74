"""The offline bundle (issue 12): ``scripts/bundle.sh`` writes one, and ``scripts/setup.sh
--bundle`` installs tpagent from it in a network namespace of its own (no interface but its
loopback: nothing can be fetched), into a fresh venv, with CRIU in a fresh prefix;
then the installed ``tpagent doctor`` runs.  A bundle is used only with its seal (given apart
from it), and a damaged one is refused before anything is installed.  The bundle is made for
this machine's Python (the GPU nodes' 3.12 is the default).
The node is made like the GPU image met on an H100: its python3 a virtual environment holding
its own packages (torch there), and no ``ip`` or ``nft`` on its PATH."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import needs_criu
from support.helpers import ROOT

pytestmark = [needs_criu, pytest.mark.timeout(600)]
PY = f"{sys.version_info.major}.{sys.version_info.minor}"


def _checkout(dst: Path) -> Path:
    """The working tree's files as git sees them (what a user's checkout holds)."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, check=True, capture_output=True
        )
        .stdout.decode()
        .split("\0")
    )
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    return dst


def _offline(*cmd: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``cmd`` in a network namespace of its own: a loopback (CRIU's kernel probe needs one), no route out."""
    ip = shutil.which("ip")
    assert ip is not None
    return subprocess.run(
        ["unshare", "--net", "--", "sh", "-c", '"$0" link set lo up && exec "$@"', ip, *cmd],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )


def _node_path(tmp: Path) -> str:
    """A PATH like the GPU image's: python3 a venv with a package of its own, no ip, no nft."""
    node = tmp / "node-python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(node)], check=True)
    where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    purelib = subprocess.run(
        [str(node / "bin" / "python"), "-c", where], capture_output=True, text=True, check=True
    ).stdout.strip()
    Path(purelib, "node_own_package.py").write_text("WHERE = 'the node'\n")
    tools = tmp / "node-bin"
    tools.mkdir()
    for d in os.environ.get("PATH", os.defpath).split(os.pathsep):
        for f in Path(d).glob("*") if Path(d).is_dir() else []:
            if f.name not in ("ip", "nft", "python3", "python") and not (tools / f.name).exists():
                (tools / f.name).symlink_to(f)
    return os.pathsep.join([str(node / "bin"), str(tools)])


def test_tpagent_installs_offline_from_a_bundle_and_its_doctor_runs(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    made = subprocess.run(
        ["bash", "scripts/bundle.sh", str(bundle), "--python", PY],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert made.returncode == 0, made.stdout + made.stderr
    size = sum(f.stat().st_size for f in bundle.rglob("*") if f.is_file())
    assert size < 64 << 20, f"the bundle is {size / 2**20:.0f} MiB"
    listed = (bundle / "requirements.txt").read_text().splitlines()
    assert all("--hash=sha256:" in ln for ln in listed) and any(ln.startswith("tpagent==") for ln in listed)

    checkout = _checkout(tmp_path / "checkout")
    venv = tmp_path / "venv"
    prefix = tmp_path / "criu"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV"))}
    env |= {"TPAGENT_VENV": str(venv), "TPAGENT_CRIU_PREFIX": str(prefix), "PATH": _node_path(tmp_path)}
    seal = (tmp_path / "bundle.seal").read_text().strip()  # (given to the node by another way than the bundle)
    assert f"its seal is {seal}" in made.stdout
    unsealed = _offline("bash", "scripts/setup.sh", "--bundle", str(bundle), cwd=checkout, env=env)
    assert unsealed.returncode == 2 and "give the bundle's seal" in unsealed.stderr, unsealed.stderr
    setup = _offline("bash", "scripts/setup.sh", "--bundle", str(bundle), "--seal", seal, cwd=checkout, env=env)
    assert setup.returncode == 0, setup.stdout + setup.stderr
    assert "offline" in setup.stdout
    seen = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import node_own_package as m; print(m.WHERE)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert seen.stdout == "the node\n", seen.stderr  # (the node's own packages: its torch, on a GPU node)
    links = subprocess.run(
        [str(venv / "bin" / "ip"), "-j", "link", "show", "lo"], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(links.stdout)[0]["ifname"] == "lo"
    nft = subprocess.run([str(venv / "bin" / "nft"), "--version"], env=env, capture_output=True, text=True, check=True)
    assert nft.stdout.startswith("nftables")

    doctor = _offline(
        str(venv / "bin" / "tpagent"), "doctor", "--json", "--criu", str(prefix / "bin" / "criu"), cwd=tmp_path, env=env
    )
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert checks["criu"]["verdict"] == "OK" and str(prefix) in checks["criu"]["message"], checks["criu"]
    assert checks["criu check"]["verdict"] == "OK", checks["criu check"]
    assert checks["root"]["verdict"] == "OK"
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import tpagent, grpc; print(tpagent.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(str(checkout)), where  # (the checkout, installed editable: its tests run as they are)

    wheel = next((bundle / "wheels").glob("grpcio-*.whl"))
    with open(wheel, "r+b") as f:  # one byte of one wheel changed
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    again = _offline("bash", "scripts/setup.sh", "--bundle", str(bundle), "--seal", seal, cwd=checkout, env=env)
    assert again.returncode == 2 and "damaged" in again.stderr, again.stdout + again.stderr
