"""What ``scripts/setup.sh --bundle`` runs as root before it trusts anything of a bundle or of the
node's Python (stdlib only; run with ``python3 -I``).

    bundle_check.py copy BUNDLE SEAL DEST
        BUNDLE's SHA256SUMS must hash to SEAL (the sha256 that scripts/bundle.sh printed, given
        by another way than the bundle: its own list proves it whole, not whose it is).  Every
        file under BUNDLE must be a regular file the list names (no symlink, nothing unlisted);
        each is copied into DEST (made new, root's, 0700) and hashed as it is copied, so what
        is installed is what was checked: the bundle is not read again.

    bundle_check.py node-site PTH VENV
        Write PTH (a .pth of VENV) that adds the node's python3's own site-packages (where it is
        itself a virtual environment, as on GPU nodes with their torch), each only if root alone
        can change it, every directory above it, and what it holds at its top (its .pth files
        run as code), and never VENV's own.

Exit status 2 with one sentence on stderr when something is refused.
"""

from __future__ import annotations

import hashlib
import os
import site
import stat
import sys
from pathlib import Path

NOFOLLOW = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


class Refused(Exception):
    pass


def _listed(bundle: Path, seal: str) -> dict[str, str]:
    """The bundle's list (path -> sha256), once it hashes to ``seal``."""
    try:
        fd = os.open(bundle / "SHA256SUMS", NOFOLLOW)
    except OSError as e:
        raise Refused(f"{bundle}/SHA256SUMS cannot be read ({e.strerror}): {bundle} is not a bundle") from e
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != seal.lower():
        raise Refused(f"the bundle {bundle} is not the one whose seal was given (its SHA256SUMS hashes otherwise)")
    listed: dict[str, str] = {}
    for line in data.decode().splitlines():
        digest, _, name = line.partition("  ")
        rel = os.path.normpath(name)
        if len(digest) != 64 or rel.startswith(("/", "..")) or rel in (".", "SHA256SUMS") or rel in listed:
            raise Refused(f"the bundle's SHA256SUMS has a line that is not a file of the bundle: {line[:120]!r}")
        listed[rel] = digest
    return listed


def _entries(bundle: Path) -> set[str]:
    """Every file under ``bundle`` (relative), refusing a symlink or anything but files and directories."""
    found = set()
    for top, dirs, files in os.walk(bundle):
        for name in [*dirs, *files]:
            path = Path(top) / name
            st = os.lstat(path)
            rel = os.path.relpath(path, bundle)
            if stat.S_ISLNK(st.st_mode):
                raise Refused(f"{path} is a symlink; a bundle holds files only")
            if stat.S_ISREG(st.st_mode):
                found.add(rel)
            elif not stat.S_ISDIR(st.st_mode):
                raise Refused(f"{path} is not a regular file; a bundle holds files only")
    return found - {"SHA256SUMS"}


def _open_under(bundle_fd: int, rel: str) -> int:
    """``rel`` opened below the bundle's directory, no symlink followed on the way."""
    at = bundle_fd
    parts = rel.split("/")
    try:
        for part in parts[:-1]:
            nxt = os.open(part, NOFOLLOW | os.O_DIRECTORY, dir_fd=at)
            if at != bundle_fd:
                os.close(at)
            at = nxt
        return os.open(parts[-1], NOFOLLOW, dir_fd=at)
    finally:
        if at != bundle_fd:
            os.close(at)


def copy(bundle: Path, seal: str, dest: Path) -> None:
    listed = _listed(bundle, seal)
    present = _entries(bundle)
    if present - listed.keys():
        raise Refused(f"{bundle}/{sorted(present - listed.keys())[0]} is not in the bundle's SHA256SUMS")
    if listed.keys() - present:
        raise Refused(f"{bundle}/{sorted(listed.keys() - present)[0]} is missing from the bundle")
    os.mkdir(dest, 0o700)  # (new: never one that someone else made)
    bundle_fd = os.open(bundle, NOFOLLOW | os.O_DIRECTORY)
    try:
        for rel, digest in sorted(listed.items()):
            src = _open_under(bundle_fd, rel)
            with os.fdopen(src, "rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                if not stat.S_ISREG(mode):
                    raise Refused(f"{bundle}/{rel} is not a regular file")
                out = dest / rel
                out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                h = hashlib.sha256()
                with open(out, "xb") as w:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
                        w.write(chunk)
            if h.hexdigest() != digest:
                raise Refused(f"{bundle}/{rel} is damaged (or changed while it was copied)")
            os.chmod(out, mode & 0o755)
    finally:
        os.close(bundle_fd)


def _root_alone_can_change(path: Path) -> str | None:
    """Why someone other than root could change ``path`` (a real path) or any directory above
    it (None: no one)."""
    at = Path("/")
    path = Path(os.path.abspath(path))
    for part in path.parts[1:]:
        at = at / part
        st = os.lstat(at)
        if stat.S_ISLNK(st.st_mode):  # (given a real path: one appeared since)
            return f"{at} is a symlink"
        if st.st_uid != 0:
            return f"{at} belongs to UID {st.st_uid}"
        sticky = st.st_mode & stat.S_ISVTX and at != path  # (above it: others add names, cannot move root's)
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky:
            return f"{at} may be written by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _unsafe(directory: Path) -> str | None:
    why = _root_alone_can_change(directory)
    if why is not None:
        return why
    for entry in os.scandir(directory):
        st = entry.stat(follow_symlinks=False)
        if st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{entry.path} is not root's alone"
    return None


def node_site(pth: Path, venv: Path) -> None:
    own = Path(os.path.realpath(venv))
    if Path(os.path.realpath(sys.prefix)) == own:
        raise Refused(
            f"the python3 first on PATH is {venv}'s own: run setup with the node's python3 first (deactivate the venv)"
        )
    dirs = site.getsitepackages() if sys.prefix != sys.base_prefix else []
    safe = []
    for d in dirs:
        real = Path(os.path.realpath(d))
        if not real.is_dir() or real == own or own in real.parents:
            continue  # (Debian's lists local/dist-packages whether or not it exists)
        why = _unsafe(real)
        if why is None:
            safe.append(str(real))
        else:
            print(f"setup: warning: not adding {d} (the node's python3's packages): {why}", file=sys.stderr)
    tmp = pth.with_suffix(".tmp")
    with open(tmp, "w") as f:
        f.writelines(f"import site; site.addsitedir({d!r})\n" for d in safe)
    tmp.rename(pth)


def main() -> int:
    try:
        if sys.argv[1:2] == ["copy"] and len(sys.argv) == 5:
            copy(Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
        elif sys.argv[1:2] == ["node-site"] and len(sys.argv) == 4:
            node_site(Path(sys.argv[2]), Path(sys.argv[3]))
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except Refused as e:
        print(f"setup: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"setup: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
