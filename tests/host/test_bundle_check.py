"""What ``scripts/setup.sh --bundle`` trusts, against a local user (scripts/bundle_check.py, as
setup runs it, as root): a bundle is used only if its list hashes to the seal given out of band,
holds nothing but the regular files it lists, and only its copy is used; the node's python3's
packages are added to the venv only where root alone can change them and what is above them,
and never the venv itself (an activated venv first on PATH)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

CHECK = Path(__file__).resolve().parent.parent.parent / "scripts" / "bundle_check.py"
UID_NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="setup runs as root")


def _check(*args: str | Path, python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-I", str(CHECK), *map(str, args)], capture_output=True, text=True, timeout=60)


def _bundle(d: Path) -> str:
    """A bundle's shape (a few files, its SHA256SUMS); its seal."""
    (d / "wheels").mkdir(parents=True)
    (d / "tools" / "lib").mkdir(parents=True)
    (d / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(os.urandom(4096))
    (d / "tools" / "lib" / "ld.so").write_bytes(b"\x7fELF" + os.urandom(100))
    (d / "requirements.txt").write_text("a==1.0\n")
    lines = []
    for f in sorted(p for p in d.rglob("*") if p.is_file()):
        lines.append(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  ./{f.relative_to(d)}\n")
    (d / "SHA256SUMS").write_text("".join(lines))
    return hashlib.sha256((d / "SHA256SUMS").read_bytes()).hexdigest()


def test_a_bundle_is_copied_whole_and_only_against_its_seal(tmp_path: Path) -> None:
    seal = _bundle(tmp_path / "b")
    out = _check("copy", tmp_path / "b", seal, tmp_path / "copy")
    assert out.returncode == 0, out.stderr
    for f in (tmp_path / "b").rglob("*"):
        if f.is_file() and f.name != "SHA256SUMS":
            assert (tmp_path / "copy" / f.relative_to(tmp_path / "b")).read_bytes() == f.read_bytes()
    assert (tmp_path / "copy").stat().st_mode & 0o777 == 0o700

    other = _check("copy", tmp_path / "b", "0" * 64, tmp_path / "copy2")
    assert other.returncode == 2 and "not the one whose seal was given" in other.stderr, other.stderr
    assert not (tmp_path / "copy2").exists()


def test_a_bundle_whose_list_a_user_made_whole_again_is_refused_without_the_seal(tmp_path: Path) -> None:
    """Its own SHA256SUMS proves a bundle whole, not whose it is: a user who swaps a file and
    writes the list again has a bundle whole by its list, and not the one sealed."""
    seal = _bundle(tmp_path / "b")
    (tmp_path / "b" / "requirements.txt").write_text("evil==6.6\n")
    lines = (tmp_path / "b" / "SHA256SUMS").read_text().splitlines()
    fixed = [
        f"{hashlib.sha256(b'evil==6.6' + bytes([10])).hexdigest()}  ./requirements.txt"
        if ln.endswith("requirements.txt")
        else ln
        for ln in lines
    ]
    (tmp_path / "b" / "SHA256SUMS").write_text("\n".join(fixed) + "\n")
    out = _check("copy", tmp_path / "b", seal, tmp_path / "copy")
    assert out.returncode == 2 and "not the one whose seal was given" in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1


def test_a_symlink_or_an_unlisted_file_in_a_bundle_is_refused(tmp_path: Path, playground: Path) -> None:
    """A symlinked tools/lib/ld.so pointing at a user's file (its hash the listed one) and a file
    the list does not name are refused, and nothing is left of the copy's files."""
    seal = _bundle(tmp_path / "b")
    ld = tmp_path / "b" / "tools" / "lib" / "ld.so"
    planted = playground / "ld.so"
    planted.write_bytes(ld.read_bytes())  # (the same bytes now; the user's to change later)
    os.chown(planted, UID_NOBODY, UID_NOBODY)
    ld.unlink()
    ld.symlink_to(planted)
    out = _check("copy", tmp_path / "b", seal, tmp_path / "copy")
    assert out.returncode == 2 and "is a symlink" in out.stderr, out.stderr

    seal = _bundle(tmp_path / "c")
    (tmp_path / "c" / "wheels" / "extra.pth").write_text("import os\n")
    out = _check("copy", tmp_path / "c", seal, tmp_path / "copy")
    assert out.returncode == 2 and "extra.pth is not in the bundle's SHA256SUMS" in out.stderr, out.stderr
    assert not (tmp_path / "copy").exists()


def _node_venv(parent: Path) -> Path:
    """The node's python3 as a virtual environment (as GPU nodes have theirs, with torch)."""
    env = parent / "nodeenv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=60)
    return env


def test_the_node_pythons_packages_are_added_only_where_root_alone_can_change_what_is_above(
    tmp_path: Path, playground: Path
) -> None:
    """A user owning a directory above the node environment could swap in a tree whose code root
    then runs from every agent Python (-I included): its packages are not added.  Under root's
    directories they are; and never the venv's own (setup run from an activated venv)."""
    planted = _node_venv(playground)
    venv = tmp_path / "venv"
    pth = tmp_path / "node-site-packages.pth"
    out = _check("node-site", pth, venv, python=str(planted / "bin" / "python"))
    assert out.returncode == 0, out.stderr
    assert f"{playground} belongs to UID {UID_NOBODY}" in out.stderr, out.stderr
    assert pth.read_text() == ""

    safe_parent = Path(tempfile.mkdtemp(dir="/run", prefix="tp-node-"))  # (/run: root's alone)
    try:
        os.chmod(safe_parent, 0o755)
        node = _node_venv(safe_parent)
        out = _check("node-site", pth, venv, python=str(node / "bin" / "python"))
        assert out.returncode == 0, out.stderr
        site_packages = next((node / "lib").glob("python3*/site-packages"))
        assert pth.read_text() == f"import site; site.addsitedir({str(site_packages.resolve())!r})\n"

        itself = _check("node-site", pth, node, python=str(node / "bin" / "python"))
        assert itself.returncode == 2 and "deactivate the venv" in itself.stderr, itself.stderr
        assert pth.read_text() == f"import site; site.addsitedir({str(site_packages.resolve())!r})\n"
    finally:
        shutil.rmtree(safe_parent, ignore_errors=True)
