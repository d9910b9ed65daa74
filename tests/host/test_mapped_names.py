"""The names of files a process maps, as root reads them (host.files.mappings): /proc/PID/maps
escapes a newline in a name (``\\012``), so that name, read from it, named nothing, and a file so
named was neither noted for the restore's checks nor carried by a migration."""

from __future__ import annotations

import mmap
import os
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
