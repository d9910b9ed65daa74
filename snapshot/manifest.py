"""The snapshot manifest: what was captured, from where, with which tools, and checksums.

``manifest.json`` is a JSON object::

    MANIFEST   ::= { "format": "tpagent-snapshot", "format_version": INT,
                     "snapshot_id": HEX, "created": ISO8601, "tpagent_version": STR,
                     "host": {"hostname", "kernel", "machine"},
                     "root_pid": INT, "namespace": BOOL,
                     "processes": [ PROCESS ], "gpus": [ GPU ],
                     "criu": {"version", "shell_job", "tcp_established"},
                     "cuda": {"driver_version", "pids": [INT]},
                     "files": { RELPATH: {"size": INT, "chunk_size": INT, "sha256": [HEX]} },
                     "total_bytes": INT, "timings": { STAGE: SECONDS } }
    PROCESS    ::= {"pid", "ppid", "cmdline": [STR], "ns_pids": [INT], "uses_cuda": BOOL}
    GPU        ::= {"index", "uuid", "name", "memory_total", "memory_used", ...}

RELPATH is relative to the snapshot directory.  Each file is hashed in CHUNK_SIZE pieces
(one SHA-256 per piece, in order) so that all cores hash a large page image at once.  A reader refuses a ``format_version``
newer than :data:`FORMAT_VERSION`; older versions are read as long as they are supported.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from snapshot.api import SnapshotInvalid
from snapshot.proc import ProcInfo

FORMAT = "tpagent-snapshot"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
IMAGES_DIR = "images"
#: Files in images/ that CRIU writes at restore time and that are not part of the snapshot.
_RUNTIME_FILES = {"restore.log", "restore.pid", "stats-restore"}


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
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())

    @property
    def cuda_pids(self) -> list[int]:
        return [int(p) for p in self.cuda.get("pids", [])]

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body["processes"] = [asdict(p) for p in self.processes]
        return {"format": FORMAT, "format_version": FORMAT_VERSION, **body, "total_bytes": self.total_bytes}

    def write(self, directory: Path) -> None:
        tmp = directory / (MANIFEST_NAME + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(directory / MANIFEST_NAME)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        procs = [
            ProcInfo(
                pid=int(p["pid"]),
                ppid=int(p["ppid"]),
                cmdline=tuple(p["cmdline"]),
                ns_pids=tuple(int(x) for x in p["ns_pids"]),
                uses_cuda=bool(p["uses_cuda"]),
            )
            for p in data["processes"]
        ]
        return cls(
            root_pid=int(data["root_pid"]),
            namespace=bool(data["namespace"]),
            processes=procs,
            gpus=list(data["gpus"]),
            criu=dict(data["criu"]),
            cuda=dict(data["cuda"]),
            tpagent_version=str(data["tpagent_version"]),
            snapshot_id=str(data["snapshot_id"]),
            created=str(data["created"]),
            host=dict(data["host"]),
            files={str(k): dict(v) for k, v in data["files"].items()},
            timings={str(k): float(v) for k, v in data["timings"].items()},
        )


CHUNK_SIZE = 64 << 20


def _sha256_chunk(job: tuple[Path, int, int]) -> str:
    path, offset, length = job
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        buf = memoryview(bytearray(min(length, 8 << 20)))
        while length > 0:
            n = f.readinto(buf[: min(length, len(buf))])
            if not n:
                break
            h.update(buf[:n])  # hashlib releases the GIL on large buffers: threads scale
            length -= n
    return h.hexdigest()


def _image_files(directory: Path) -> list[Path]:
    images = directory / IMAGES_DIR
    return sorted(p for p in images.iterdir() if p.is_file() and p.name not in _RUNTIME_FILES)


def checksum_files(directory: Path, workers: int | None = None) -> dict[str, dict[str, Any]]:
    """Size and per-chunk SHA-256 of every file under images/, hashed on all cores."""
    paths = _image_files(directory)
    sizes = [p.stat().st_size for p in paths]
    jobs = [(p, off, min(CHUNK_SIZE, size - off)) for p, size in zip(paths, sizes) for off in range(0, max(size, 1), CHUNK_SIZE)]
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 2) as pool:
        digests = iter(pool.map(_sha256_chunk, jobs))
    out: dict[str, dict[str, Any]] = {}
    for p, size in zip(paths, sizes):
        n = max(1, -(-size // CHUNK_SIZE))
        out[str(p.relative_to(directory))] = {"size": size, "chunk_size": CHUNK_SIZE, "sha256": [next(digests) for _ in range(n)]}
    return out


def load(directory: Path) -> Manifest:
    """Read the manifest of a snapshot directory, or say in one sentence why it is not one."""
    if not directory.is_dir():
        raise SnapshotInvalid(f"{directory} does not exist or is not a directory.")
    path = directory / MANIFEST_NAME
    if not path.is_file():
        raise SnapshotInvalid(f"{directory} is not a tpagent snapshot: it has no {MANIFEST_NAME}.")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SnapshotInvalid(f"{path} is corrupt: it is not valid JSON ({e}).") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SnapshotInvalid(f"{path} is not a tpagent snapshot manifest (wrong or missing 'format').")
    version = data.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise SnapshotInvalid(f"{path} has no valid format_version.")
    if version > FORMAT_VERSION:
        raise SnapshotInvalid(
            f"{directory} was written in snapshot format {version} by a newer tpagent; "
            f"this one reads up to format {FORMAT_VERSION}: upgrade tpagent on this node."
        )
    try:
        return Manifest.from_json(data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise SnapshotInvalid(f"{path} is corrupt: a field is missing or malformed ({e!r}).") from e


def verify(directory: Path, manifest: Manifest) -> None:
    """Check every image file against the manifest: presence, size, then SHA-256."""
    listed = set(manifest.files)
    if not listed:
        raise SnapshotInvalid(f"{directory}'s manifest lists no image files.")
    for rel in sorted(listed):
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise SnapshotInvalid(f"{directory}'s manifest names a file outside the snapshot: {rel}.")
        path = directory / rel
        if not path.is_file():
            raise SnapshotInvalid(f"{directory} is incomplete: {rel} is missing.")
        size, want = path.stat().st_size, int(manifest.files[rel]["size"])
        if manifest.files[rel].get("chunk_size") != CHUNK_SIZE:
            raise SnapshotInvalid(f"{directory}'s manifest has an unknown chunk size for {rel}.")
        if size != want:
            raise SnapshotInvalid(f"{directory} is truncated or altered: {rel} has {size} bytes, the manifest says {want}.")
    extra = {str(p.relative_to(directory)) for p in _image_files(directory)} - listed
    if extra:
        raise SnapshotInvalid(f"{directory} holds image files the manifest does not list: {', '.join(sorted(extra))}.")
    actual = checksum_files(directory)
    for rel in sorted(listed):
        if actual[rel]["sha256"] != manifest.files[rel]["sha256"]:
            raise SnapshotInvalid(f"{directory} is damaged: {rel} does not match its checksum.")
