"""The snapshot manifest: what was captured, from where, with which tools, and checksums.

``manifest.json`` is a JSON object::

    MANIFEST   ::= { "format": "tpagent-snapshot", "format_version": INT,
                     "snapshot_id": HEX, "created": ISO8601, "tpagent_version": STR,
                     "host": {"hostname", "kernel", "machine"},
                     "root_pid": INT, "namespace": BOOL,
                     "processes": [ PROCESS ], "gpus": [ GPU ],
                     "criu": {"version", "shell_job", "tcp_established"},
                     "cuda": {"driver_version", "pids": [INT], "forked": [FORKED] (optional)},
                     "digest": "blake3" | "sha256",
                     "files": { RELPATH: {"size": INT, "chunk_size": INT, "digests": [HEX]} },
                     "total_bytes": INT, "timings": { STAGE: SECONDS },
                     "origin": {"mode": MODE, "root_create_time": FLOAT,
                                "root_started": TICKS "@" BOOT_ID},  (optional, host.proc.started: the
                                                        root's identity; the wall clock's is shown only)
                     "carried": [ ABSPATH ],                 (optional: files kept in images/tpagent-files.tar)
                     "links": { ABSPATH: ABSPATH },          (optional: CRIU's link_remap.N -> a carried file)
                     "timers": [ TIMER ],                    (optional: timerfds to arm again on restore)
                     "bindings": [ BINDING ],                (optional: threads to bind to their CPUs again)
                     "sockets": [ SOCKET ],                  (optional: where unix sockets are bound)
                     "dirs": [ DIR ],                        (optional: the directories on their way)
                     "warnings": [ STR ] }                   (optional: what a restore may not bring back)
    MODE       ::= "kill" | "leave-running" | "leave-stopped"   (how the original was left)
    TIMER      ::= {"pid": INT, "fd": INT, "interval_ns": INT}   (see snapshot.timers)
    BINDING    ::= {"pid": INT, "tid": INT, "cpus": "0-3,8"}     (see snapshot.affinity)
    SOCKET     ::= {"path": ABSPATH, "uid": INT, "dev": INT, "ino": INT, "ctime_ns": INT}
                                                        (its file's owner, and which file it is)
    DIR        ::= {"path": ABSPATH, "uid": INT, "gid": INT, "mode": INT}   (parents first)
    PROCESS    ::= {"pid", "ppid", "cmdline": [STR], "ns_pids": [INT], "uses_cuda": BOOL,
                     "tids": [INT]}                         (optional: its other threads' IDs)
    GPU        ::= {"index", "uuid", "name", "memory_total", "memory_used", ...}
    FORKED     ::= {"pid", "name", "mappings": [[HEX, HEX, PATH]], "fds": [[INT, PATH]]}
                     (a child forked after CUDA started: the GPU driver's leftovers removed from it)

RELPATH is relative to the snapshot directory.  Each file is hashed in CHUNK_SIZE pieces
(one digest per piece, in order, with the manifest's ``digest``: BLAKE3 as written now, about
three times SHA-256's rate on a core) so that all cores hash a large page image at once, and a
receiver checks each piece as it arrives.  A reader refuses a ``format_version`` newer than
:data:`FORMAT_VERSION`; older versions are read as long as they are supported.  Format 1 (no
``digest``; each file's SHA-256s under ``"sha256"``) is read as format 2 with ``"sha256"``.
The manifest's own checksum (``manifest_sha256``) is SHA-256 in every format.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import re
import stat
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import blake3

from host.proc import ProcInfo
from host.reopened import Reopened
from host.safefs import private_opener
from snapshot import typed as read
from snapshot.affinity import Binding
from snapshot.api import SnapshotInvalid
from snapshot.timers import Timer
from snapshot.typed import typed, typed_list, typed_rows

FORMAT = "tpagent-snapshot"
FORMAT_VERSION = 2
#: The chunk digest new snapshots are sealed with, and those a reader knows.
DIGEST = "blake3"
DIGESTS: dict[str, Callable[..., Any]] = {"blake3": blake3.blake3, "sha256": hashlib.sha256}
MANIFEST_NAME = "manifest.json"
IMAGES_DIR = "images"
#: The archive of carried files, among the images (CRIU ignores files it does not know).
CARRIED_NAME = "tpagent-files.tar"


@dataclass(frozen=True)
class BoundSocket:
    """Where a unix socket of the processes is bound, who owns its file, and which file it is."""

    path: str
    uid: int
    dev: int
    ino: int
    ctime_ns: int


@dataclass(frozen=True)
class MadeDir:
    """A directory of their owner's on the way to a bound unix socket or a carried file, as it
    was on the source: a restore makes it where missing."""

    path: str
    uid: int
    gid: int
    mode: int


@dataclass
class Manifest:
    root_pid: int
    namespace: bool
    processes: list[ProcInfo]
    gpus: list[dict[str, Any]]
    criu: dict[str, Any]
    cuda: dict[str, Any]
    tpagent_version: str
    snapshot_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    host: dict[str, str] = field(
        default_factory=lambda: {
            "hostname": platform.node(),
            "kernel": platform.release(),
            "machine": platform.machine(),
        }
    )
    #: How the original was left ("mode") and its identity, to refuse two running copies.
    origin: dict[str, Any] = field(default_factory=lambda: {"mode": "kill", "root_create_time": 0.0})
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The algorithm of ``files``' chunk digests (:data:`DIGESTS`).
    digest: str = DIGEST
    timings: dict[str, float] = field(default_factory=dict)
    #: Absolute paths of node-local files the processes had open, archived (as they were
    #: while frozen) in images/CARRIED_NAME and put back in place before a restore.
    carried: list[str] = field(default_factory=list)
    #: The names CRIU gave relinked files (``link_remap.N``: :class:`host.files.Relinked`), each
    #: to be made again, before the restore opens it, as a hard link to a carried file beside it.
    links: dict[str, str] = field(default_factory=dict)
    #: Periodic timerfds that had expired unread while frozen: CRIU restores them disarmed,
    #: the restore arms them again (:mod:`snapshot.timers`).
    timers: list[Timer] = field(default_factory=list)
    #: Threads bound to some of their CPUs, which CRIU does not keep: bound again on restore
    #: (:mod:`snapshot.affinity`).
    bindings: list[Binding] = field(default_factory=list)
    #: Where the processes' unix sockets are bound (CRIU binds them there again), and the
    #: directories on the way to them as they were (made where missing before a restore).
    sockets: list[BoundSocket] = field(default_factory=list)
    dirs: list[MadeDir] = field(default_factory=list)
    #: One sentence each: state of the processes that a restore may not bring back as it was.
    warnings: list[str] = field(default_factory=list)
    #: The paths CRIU opens again by name, and the directories on the way, as they were: a
    #: restore refuses one whose copy it finds is not to be trusted (:mod:`host.reopened`).
    reopened: list[Reopened] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())

    @property
    def cuda_pids(self) -> list[int]:
        return [int(p) for p in self.cuda.get("pids", [])]

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)  # (the rows of its lists too)
        body = {"format": FORMAT, "format_version": FORMAT_VERSION, **body, "total_bytes": self.total_bytes}
        return {**body, "manifest_sha256": _body_digest(body)}

    def write(self, directory: Path) -> None:
        tmp = directory / (MANIFEST_NAME + ".tmp")
        with open(tmp, "w", opener=private_opener) as f:
            json.dump(self.to_json(), f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(directory / MANIFEST_NAME)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        """Build from parsed JSON, checking every field's type; ValueError names a bad one."""
        procs = read.processes(data)
        gpus = typed_list(data, "gpus", dict, "manifest")
        for g in gpus:
            typed(g, "uuid", str, "gpus[]"), typed(g, "name", str, "gpus[]")
            if not 0 <= typed(g, "memory_used", int, "gpus[]") < 1 << 63:
                raise ValueError("gpus[].memory_used")
        criu = typed(data, "criu", dict, "manifest")
        if not re.fullmatch(r"\d+\.\d+(\.\d+)?", typed(criu, "version", str, "criu")):
            raise ValueError("criu.version")
        typed(criu, "shell_job", bool, "criu"), typed(criu, "tcp_established", bool, "criu")
        pids = {p.pid for p in procs}
        root_pid = read.root_pid(data, procs)
        cuda = read.cuda_table(data, pids)
        host = typed(data, "host", dict, "manifest")
        for key in ("hostname", "kernel", "machine"):
            typed(host, key, str, "host")
        files, digest = _files(data)
        origin = typed(data, "origin", dict, "manifest")
        typed(origin, "mode", str, "origin"), typed(origin, "root_create_time", float, "origin")
        carried = typed_list(data, "carried", str, "manifest") if "carried" in data else []
        if not all(read.absolute(p) for p in carried):
            raise ValueError("carried: not a normalised absolute path")
        if carried and f"{IMAGES_DIR}/{CARRIED_NAME}" not in files:
            raise ValueError(f"carried: names files but {IMAGES_DIR}/{CARRIED_NAME} is not among the files")
        links = read.links(data, carried)
        timers = typed_rows(data, "timers", Timer)
        if not {t.pid for t in timers} <= pids:
            raise ValueError("timers names a process not in processes")
        bindings = read.bindings(data, procs)
        sockets = typed_rows(data, "sockets", BoundSocket)
        dirs = typed_rows(data, "dirs", MadeDir)
        paths = [*(b.path for b in sockets), *(d.path for d in dirs)]
        if not all(read.absolute(p) for p in paths) or any(d.path == "/" for d in dirs):
            raise ValueError("sockets, dirs: not a normalised absolute path")
        if any(min(b.uid, b.dev, b.ino, b.ctime_ns) < 0 for b in sockets) or any(
            min(d.uid, d.gid) < 0 or not 0 <= d.mode <= 0o7777 for d in dirs
        ):
            raise ValueError("sockets, dirs: not a user, group or mode")
        if not all(
            any(b.uid == d.uid and b.path.startswith(d.path + "/") for b in sockets)
            or any(c.startswith(d.path + "/") for c in carried)  # (of its owner: the restore checks by the file)
            for d in dirs
        ):
            raise ValueError("dirs: one is not on the way to a socket of its owner or a carried file")
        return cls(
            root_pid=root_pid,
            namespace=typed(data, "namespace", bool, "manifest"),
            processes=procs,
            gpus=gpus,
            criu=criu,
            cuda=cuda,
            tpagent_version=typed(data, "tpagent_version", str, "manifest"),
            snapshot_id=typed(data, "snapshot_id", str, "manifest"),
            created=typed(data, "created", str, "manifest"),
            host=host,
            origin=origin,
            files=files,
            digest=digest,
            timings={
                str(k): typed({k: v}, k, float, "timings") for k, v in typed(data, "timings", dict, "manifest").items()
            },
            carried=carried,
            links=links,
            timers=timers,
            bindings=bindings,
            sockets=sockets,
            dirs=dirs,
            warnings=typed_list(data, "warnings", str, "manifest") if "warnings" in data else [],
            reopened=read.reopened_rows(data),
        )


def _files(data: Any) -> tuple[dict[str, dict[str, Any]], str]:
    """The image files with their chunk digests, and the digests' algorithm (format 1's: SHA-256)."""
    version = typed(data, "format_version", int, "manifest")
    digest = typed(data, "digest", str, "manifest") if version >= 2 else "sha256"
    if digest not in DIGESTS:
        raise ValueError("digest")
    listed = "digests" if version >= 2 else "sha256"
    files = {}
    for rel, f in typed(data, "files", dict, "manifest").items():
        if not _IMAGE_PATH.fullmatch(rel):
            raise ValueError(f"files: {rel!r} is not a file directly under {IMAGES_DIR}/")
        files[rel] = {
            "size": typed(f, "size", int, rel),
            "chunk_size": typed(f, "chunk_size", int, rel),
            "digests": typed_list(f, listed, str, rel),
        }
    return files, digest


_IMAGE_PATH = re.compile(IMAGES_DIR + r"/[A-Za-z0-9._-]+")


def _body_digest(body: dict[str, Any]) -> str:
    canonical = json.dumps(
        {k: v for k, v in body.items() if k != "manifest_sha256"}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


CHUNK_SIZE = 8 << 20  # the transfer's default chunk: a receiver checks each chunk as it arrives


def chunk_digest(job: tuple[Path, int, int], digest: str = DIGEST) -> str:
    """The ``digest`` of ``length`` bytes of a file from ``offset``: one manifest chunk's."""
    path, offset, length = job
    h = DIGESTS[digest]()
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        buf = memoryview(bytearray(min(length, 8 << 20)))
        while length > 0:
            n = f.readinto(buf[: min(length, len(buf))])
            if not n:
                break
            h.update(buf[:n])  # (both release the GIL on large buffers: reading and hashing overlap)
            length -= n
    return str(h.hexdigest())


def _image_files(directory: Path) -> list[Path]:
    """The files of images/; anything but a regular file there (a symlink that could make a
    root CRIU write elsewhere, a device, a folder) makes the snapshot invalid."""
    images = directory / IMAGES_DIR
    out = []
    for p in sorted(images.iterdir()):
        if not stat.S_ISREG(p.lstat().st_mode):
            raise SnapshotInvalid(f"{directory} is unsafe: {p.relative_to(directory)} is not a regular file.")
        out.append(p)
    return out


def checksum_files(directory: Path, workers: int | None = None, digest: str = DIGEST) -> dict[str, dict[str, Any]]:
    """Size and per-chunk ``digest`` of every file under images/, hashed on all cores."""
    paths = _image_files(directory)
    sizes = [p.stat().st_size for p in paths]
    jobs = [
        (p, off, min(CHUNK_SIZE, size - off))
        for p, size in zip(paths, sizes, strict=False)
        for off in range(0, max(size, 1), CHUNK_SIZE)
    ]
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 2) as pool:
        digests = iter(pool.map(partial(chunk_digest, digest=digest), jobs))
    out: dict[str, dict[str, Any]] = {}
    for p, size in zip(paths, sizes, strict=False):
        n = max(1, -(-size // CHUNK_SIZE))
        out[str(p.relative_to(directory))] = {
            "size": size,
            "chunk_size": CHUNK_SIZE,
            "digests": [next(digests) for _ in range(n)],
        }
    return out


#: The most a manifest may hold (it lists a tree's processes and files: a few MiB at most).
MANIFEST_MOST = 64 << 20


def present(directory: Path) -> None:
    """SnapshotInvalid unless ``directory`` is a directory holding a manifest: checked before
    anything is done to it (a directory given by mistake, a home, is left as it was)."""
    for path, kind, missing in (
        (directory, stat.S_ISDIR, "does not exist or is not a directory"),
        (directory / MANIFEST_NAME, stat.S_ISREG, _NO_MANIFEST),
    ):
        try:  # (the manifest never through a link: one to /proc/kmsg hung a root's inspect)
            ok = kind(os.stat(path, follow_symlinks=path == directory).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            ok = False
        except OSError as e:
            raise SnapshotInvalid(f"{directory} cannot be read as a tpagent snapshot: {e.strerror}.") from e
        if not ok:
            raise SnapshotInvalid(f"{directory} {missing}.")


_NO_MANIFEST = f"is not a tpagent snapshot: it has no {MANIFEST_NAME} file of its own"


def load(directory: Path) -> Manifest:
    """Read the manifest of a snapshot directory, or say in one sentence why it is not one."""
    present(directory)
    path = directory / MANIFEST_NAME
    try:  # (nor a FIFO, tty or link put there since: opening one does nothing, and it is refused)
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC), "rb") as f:
            text = f.read(MANIFEST_MOST + 1) if stat.S_ISREG(os.fstat(f.fileno()).st_mode) else None
    except OSError as e:
        raise SnapshotInvalid(
            f"{directory} {_NO_MANIFEST}." if e.errno == errno.ELOOP else f"{path} cannot be read ({e.strerror})."
        ) from e
    if text is None:
        raise SnapshotInvalid(f"{directory} {_NO_MANIFEST}.")
    try:
        if len(text) > MANIFEST_MOST:
            raise SnapshotInvalid(f"{path} is corrupt: it is larger than {MANIFEST_MOST >> 20} MiB.")
        data = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # (ValueError: JSON's, or a number's)
        raise SnapshotInvalid(f"{path} is corrupt: it is not valid JSON ({e}).") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SnapshotInvalid(f"{path} is not a tpagent snapshot manifest (wrong or missing 'format').")
    version = data.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise SnapshotInvalid(f"{path} has no valid format_version.")
    if version <= FORMAT_VERSION and data.get("manifest_sha256") != _body_digest(data):
        raise SnapshotInvalid(f"{path} is damaged: it does not match its own checksum.")
    if version > FORMAT_VERSION:
        raise SnapshotInvalid(
            f"{directory} was written in snapshot format {version} by a newer tpagent; "
            f"this one reads up to format {FORMAT_VERSION}: upgrade tpagent on this node."
        )
    try:
        return Manifest.from_json(data)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        said = str(e).strip("'")  # (a field's name, or what is wrong with one, in words)
        what = said if " " in said else f"field {said} is missing or malformed"
        raise SnapshotInvalid(f"{path} is corrupt: {what}.") from e


def verify(
    directory: Path, manifest: Manifest, digests: Mapping[str, list[str]] | None = None, digest: str = DIGEST
) -> None:
    """Check every image file against the manifest: type, presence, size, then its digests.

    ``digests`` (file -> chunk digests, of the algorithm ``digest``) are ones already computed as
    the data arrived; without them, or of another algorithm than the manifest's, every file is
    hashed now."""
    try:
        _verify(directory, manifest, digests if digest == manifest.digest else None)
    except OSError as e:
        raise SnapshotInvalid(f"{directory} cannot be read: {e.strerror} ({e.filename}).") from e


def _verify(directory: Path, manifest: Manifest, digests: Mapping[str, list[str]] | None) -> None:
    listed = set(manifest.files)
    if not listed:
        raise SnapshotInvalid(f"{directory}'s manifest lists no image files.")
    present = {str(p.relative_to(directory)): p.lstat().st_size for p in _image_files(directory)}
    for rel in sorted(listed):
        if rel not in present:
            raise SnapshotInvalid(f"{directory} is incomplete: {rel} is missing.")
        if manifest.files[rel]["chunk_size"] != CHUNK_SIZE:
            raise SnapshotInvalid(f"{directory}'s manifest has an unknown chunk size for {rel}.")
        want = manifest.files[rel]["size"]
        if present[rel] != want:
            raise SnapshotInvalid(
                f"{directory} is truncated or altered: {rel} has {present[rel]} bytes, the manifest says {want}."
            )
    extra = set(present) - listed
    if extra:
        raise SnapshotInvalid(f"{directory} holds image files the manifest does not list: {', '.join(sorted(extra))}.")
    if digests is None:
        digests = {k: v["digests"] for k, v in checksum_files(directory, digest=manifest.digest).items()}
    for rel in sorted(listed):
        if digests.get(rel) != manifest.files[rel]["digests"]:
            raise SnapshotInvalid(f"{directory} is damaged: {rel} does not match its checksum.")
