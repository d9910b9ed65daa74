"""The names of files a process maps, as root reads them (host.files.mappings): /proc/PID/maps
escapes a newline in a name (``\\012``), so that name, read from it, named nothing, and a file so
named was neither noted for the restore's checks nor carried by a migration."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

from host import files, reopened


def test_a_mapped_file_with_a_newline_in_its_name_is_known_by_its_whole_name(tmp_path: Path) -> None:
    odd = tmp_path / "seg\nment"
    odd.write_bytes(b"x" * 4096)
    with open(odd, "r+b") as f:
        shared = mmap.mmap(f.fileno(), 4096)  # (shared, writable: a migration carries it)
    try:
        assert str(odd) in [fields[5] for fields in files.mappings(os.getpid())]
        assert str(odd) in [r.path for r in reopened.note([os.getpid()])]
    finally:
        shared.close()


def test_a_removed_file_is_known_by_the_directories_on_its_way_and_checked_there_once_restored(
    tmp_path: Path,
) -> None:
    """A removed file a process holds: CRIU puts its bytes back in its directory, as root, under
    its old name, then removes it.  The directories on its way are noted (not the file: no name
    leads to it), and a process that holds such a file in another directory than the one checked
    is a stranger (a directory swapped for a symlink as CRIU restored it)."""
    ghost = tmp_path / "d" / "g"
    ghost.parent.mkdir()
    with subprocess.Popen(
        [sys.executable, "-c", HOLD, str(ghost)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, cwd=tmp_path
    ) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline() == b"removed\n"
            noted = reopened.note([holder.pid])
            assert holder.poll() is None
            paths = {r.path for r in noted}
            assert str(ghost.parent) in paths and str(tmp_path) in paths and str(ghost) not in paths
            checked: dict[str, tuple[int, int]] = {}
            assert reopened.untrusted(noted, (), (), "here", checked) == []
            assert reopened.strangers([holder.pid], checked) == []
            swapped = checked | {str(ghost.parent): checked[str(tmp_path)]}  # (what was checked there is not it)
            assert reopened.strangers([holder.pid], swapped) == [f"PID {holder.pid} holds {ghost}{files.DELETED}"]
        finally:
            holder.kill()


#: Holds the file argv[1] names, removed, until killed.
HOLD = """
import os, signal, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
os.unlink(sys.argv[1])
print("removed", flush=True)
signal.pause()
"""
