"""A moved rank's NCCL binds to the node it now runs on (tpagent_rank.nccladdr).

NCCL keeps its node's address from its first communicator for the life of the process: after a
move every communicator it builds binds to the source's address and fails (seen on an H100:
"Call to bind failed: Cannot assign requested address").  Without a GPU there is no NCCL here,
so a small library does what NCCL does with the address (tests/workloads/nccl_standin.c: kept
in a static variable at the first call, bound and read back at each listen) and the node's
address changes under a live process in a network namespace of its own, as it does for a
process restored on another node.  The GPU tests (test_rewire_gpu.py) move real NCCL ranks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a network namespace of its own)")

# Runs in a network namespace of its own: veth tpa0 (its peer up too) with 10.77.0.1, the
# library's first call keeps it; then the node changes as the case says.
SCRIPT = r"""
import ctypes, json, subprocess, sys
sys.path.insert(0, sys.argv[2])
from tpagent_rank import nccladdr

def ip(*args):
    subprocess.run(["ip", *args], check=True)

def call(fn):
    buf = ctypes.create_string_buffer(64)
    rc = fn(buf, 64)
    return rc, buf.value.decode()

ip("link", "add", "tpa0", "type", "veth", "peer", "name", "tpa1")
ip("addr", "add", "10.77.0.1/24", "dev", "tpa0")
for name in ("lo", "tpa0", "tpa1"):
    ip("link", "set", name, "up")
lib = ctypes.CDLL(sys.argv[1])
out = {"init": call(lib.standin_init), "first": call(lib.standin_listen)}
before = nccladdr.local_addresses()

# Where the kept address lies: past the file, in the mapping the loader made anonymous for the
# rest of the .bss (as NCCL's does).  The end of that page lies past every variable of the
# library, in the same mapping: a sockaddr put there is not the library's, and must be left.
lib.standin_kept.restype = ctypes.c_void_p
kept = lib.standin_kept()
for line in open("/proc/self/maps"):
    parts = line.split()
    start, stop = (int(x, 16) for x in parts[0].split("-"))
    if start <= kept < stop:
        out["kept_in"] = parts[5] if len(parts) > 5 else ""
spare = (kept | 4095) + 1 - 16
assert spare >= kept + 64, "the stand-in's address is too near the end of its page"
ctypes.memmove(spare, ctypes.string_at(kept, 16), 16)
case = sys.argv[3]
if case == "same-name":  # the new node's interface has the old one's name, another address
    ip("addr", "del", "10.77.0.1/24", "dev", "tpa0")
    ip("addr", "add", "10.77.0.2/24", "dev", "tpa0")
elif case == "other-name":  # none of that name: the one the store is reached from
    ip("link", "del", "tpa0")
    ip("link", "add", "tpb0", "type", "veth", "peer", "name", "tpb1")
    ip("addr", "add", "10.77.0.3/24", "dev", "tpb0")
    ip("link", "set", "tpb0", "up")
    ip("link", "set", "tpb1", "up")
out["moved"] = call(lib.standin_listen)
out["said"] = nccladdr.follow(before, "10.77.0.9")
out["after"] = call(lib.standin_listen)
out["again"] = nccladdr.follow(nccladdr.local_addresses(), "10.77.0.9")
out["spare"] = ".".join(str(b) for b in ctypes.string_at(spare + 4, 4))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler (scripts/setup.sh installs gcc)"
    lib = tmp_path_factory.mktemp("standin") / "libnccl-standin.so"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-o", str(lib), str(ROOT / "tests/workloads/nccl_standin.c")], check=True
    )
    return lib


def _run(lib: Path, case: str) -> dict[str, list[object] | str | None]:
    """The script in a network namespace of its own, for ``case``; what it printed."""
    out = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", SCRIPT, str(lib), str(ROOT), case],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    import json

    doc: dict[str, list[object] | str | None] = json.loads(out.stdout)
    return doc


@pytest.mark.parametrize(("case", "new"), [("same-name", "10.77.0.2"), ("other-name", "10.77.0.3")])
def test_a_library_that_kept_the_old_address_binds_to_the_new_one(standin: Path, case: str, new: str) -> None:
    doc = _run(standin, case)
    assert doc["init"] == [0, "10.77.0.1"]
    assert doc["kept_in"] == "", "the stand-in's address is not in its anonymous .bss: the test shows less than it says"
    rc, first = doc["first"]  # type: ignore[misc]
    assert rc == 0 and str(first).startswith("10.77.0.1:")
    # as NCCL failed on the H100: its kept address is not this node's any more
    assert doc["moved"] == [-99, ""], doc  # EADDRNOTAVAIL
    assert doc["said"] is not None and f"10.77.0.1 -> {new}" in str(doc["said"]) and "1 in all" in str(doc["said"])
    rc, after = doc["after"]  # type: ignore[misc]
    assert rc == 0 and str(after).startswith(new + ":"), doc
    assert doc["again"] is None  # nothing left to rewrite once the node's addresses are its own
    assert doc["spare"] == "10.77.0.1"  # (past the library's segment: not its own)
