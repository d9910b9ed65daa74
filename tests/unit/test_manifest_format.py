"""snapshot.manifest: a written manifest reads back; a damaged, foreign or newer one is SnapshotInvalid."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile
from pathlib import Path
from typing import Any

import blake3
import pytest

from host.proc import ProcInfo
from snapshot import manifest, putback
from snapshot.api import SnapshotInvalid
from snapshot.manifest import Manifest


def _manifest(**changes: Any) -> Manifest:
    fields: dict[str, Any] = {
        "root_pid": 100,
        "namespace": True,
        "processes": [ProcInfo(100, 1, ("python", "train.py"), (5100, 1), True, (101, 102))],
        "gpus": [{"index": 0, "uuid": "GPU-1", "name": "H100", "memory_total": 80, "memory_used": 3}],
        "criu": {"version": "4.2", "shell_job": False, "tcp_established": True},
        "cuda": {"driver_version": 12080, "pids": [100]},
        "tpagent_version": "0.1.0",
    }
    return Manifest(**(fields | changes))


#: A manifest's carried file (its archive among the files), for links to name.
_CARRIED: dict[str, Any] = {
    "carried": ["/dev/shm/sem.a"],
    "files": {f"{manifest.IMAGES_DIR}/{manifest.CARRIED_NAME}": {"size": 0, "chunk_size": 1, "digests": []}},
}


def test_a_link_to_a_carried_file_reads_back(tmp_path: Path) -> None:
    _manifest(**_CARRIED, links={"/dev/shm/link_remap.3": "/dev/shm/sem.a"}).write(tmp_path)
    assert manifest.load(tmp_path).links == {"/dev/shm/link_remap.3": "/dev/shm/sem.a"}


@pytest.fixture
def snap(tmp_path: Path) -> Path:
    """A snapshot directory: two image files and the manifest of their checksums."""
    images = tmp_path / "snap" / manifest.IMAGES_DIR
    images.mkdir(parents=True)
    (images / "pages-1.img").write_bytes(os.urandom(3000))
    (images / "core-100.img").write_bytes(b"")
    m = _manifest()
    m.files = manifest.checksum_files(images.parent)
    m.write(images.parent)
    return images.parent


def _rewrite(snap: Path, edit: Any) -> Path:
    path = snap / manifest.MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


def test_a_written_manifest_reads_back_and_verifies(snap: Path) -> None:
    loaded = manifest.load(snap)
    assert loaded.processes == _manifest().processes
    assert loaded.files["images/pages-1.img"]["size"] == 3000
    assert loaded.total_bytes == 3000
    assert loaded.cuda_pids == [100]
    manifest.verify(snap, loaded)


def test_the_manifest_is_private_and_names_its_format(snap: Path) -> None:
    path = snap / manifest.MANIFEST_NAME
    assert path.stat().st_mode & 0o777 == 0o600
    data = json.loads(path.read_text())
    assert (data["format"], data["format_version"]) == ("tpagent-snapshot", manifest.FORMAT_VERSION)
    assert data["total_bytes"] == 3000 and len(data["manifest_sha256"]) == 64


def test_a_changed_field_breaks_the_manifests_own_checksum(snap: Path) -> None:
    _rewrite(snap, lambda d: d.update(root_pid=101))
    with pytest.raises(SnapshotInvalid, match="does not match its own checksum"):
        manifest.load(snap)


def test_a_foreign_json_file_is_not_a_manifest(snap: Path) -> None:
    _rewrite(snap, lambda d: d.update(format="docker-image"))
    with pytest.raises(SnapshotInvalid, match="not a tpagent snapshot manifest"):
        manifest.load(snap)
    (snap / manifest.MANIFEST_NAME).write_text("[1, 2]")
    with pytest.raises(SnapshotInvalid, match="not a tpagent snapshot manifest"):
        manifest.load(snap)


def test_a_newer_format_is_refused_with_what_to_do(snap: Path) -> None:
    _rewrite(snap, lambda d: d.update(format_version=manifest.FORMAT_VERSION + 1))
    with pytest.raises(SnapshotInvalid, match="by a newer tpagent.*upgrade tpagent on this node"):
        manifest.load(snap)


@pytest.mark.parametrize("version", [0, -1, "1", None, 1.0])
def test_an_invalid_format_version_is_refused(snap: Path, version: object) -> None:
    _rewrite(snap, lambda d: d.update(format_version=version))
    with pytest.raises(SnapshotInvalid, match="no valid format_version"):
        manifest.load(snap)


def test_garbage_missing_and_non_directories_are_refused(tmp_path: Path, snap: Path) -> None:
    with pytest.raises(SnapshotInvalid, match="does not exist or is not a directory"):
        manifest.load(tmp_path / "nothing")
    with pytest.raises(SnapshotInvalid, match="it has no manifest.json"):
        manifest.load(snap / manifest.IMAGES_DIR)
    (snap / manifest.MANIFEST_NAME).write_bytes(b'{"format": "tpagent-snap\xff')
    with pytest.raises(SnapshotInvalid, match="is corrupt: it is not valid JSON"):
        manifest.load(snap)


def test_a_manifest_is_read_from_its_own_file_never_through_a_link_a_fifo_or_a_tty(
    tmp_path: Path, snap: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory anyone may have written (``inspect``'s): a manifest.json that is a link (to
    /proc/kmsg, whose read hung a root's inspect and took the kernel's log; to root's own files)
    or a FIFO, tty or link put there after the check, is refused at once, nothing read through it."""
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / manifest.MANIFEST_NAME).symlink_to(snap / manifest.MANIFEST_NAME)  # (a good one, even)
    with pytest.raises(SnapshotInvalid, match="it has no manifest.json file of its own"):
        manifest.load(planted)
    monkeypatch.setattr(manifest, "present", lambda directory: None)  # (swapped after the check)
    with pytest.raises(SnapshotInvalid, match="it has no manifest.json file of its own"):
        manifest.load(planted)
    (planted / manifest.MANIFEST_NAME).unlink()
    os.mkfifo(planted / manifest.MANIFEST_NAME)  # (opening it for reading waited for a writer)
    with pytest.raises(SnapshotInvalid, match="it has no manifest.json file of its own"):
        manifest.load(planted)
    (planted / manifest.MANIFEST_NAME).unlink()
    (planted / manifest.MANIFEST_NAME).symlink_to("/dev/tty")
    with pytest.raises(SnapshotInvalid, match="it has no manifest.json file of its own"):
        manifest.load(planted)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"cuda": {"driver_version": 1, "pids": [999]}}, "cuda.pids names a process not in processes"),
        ({"criu": {"version": "4.2; rm -rf /", "shell_job": False, "tcp_established": True}}, "criu.version"),
        (
            {"files": {"../../etc/shadow": {"size": 1, "chunk_size": 1, "sha256": []}}},
            "is not a file directly under images/",
        ),
        ({"files": {"images/a": {"size": "1", "chunk_size": 1, "sha256": []}}}, "images/a.size"),
        ({"carried": ["relative/path"]}, "carried: not a normalised absolute path"),
        ({"carried": ["/a/../etc/shadow"]}, "carried: not a normalised absolute path"),
        ({"carried": ["/home/u/data"]}, "carried: names files but images/tpagent-files.tar is not among the files"),
        ({"origin": {"mode": "kill"}}, "origin.root_create_time"),
        ({**_CARRIED, "links": {"/dev/shm/link_remap.3": "/dev/shm/sem.b"}}, "links: not a link_remap.N beside"),
        ({**_CARRIED, "links": {"/dev/shm/authorized_keys": "/dev/shm/sem.a"}}, "links: not a link_remap.N beside"),
        ({**_CARRIED, "links": {"/etc/link_remap.3": "/dev/shm/sem.a"}}, "links: not a link_remap.N beside"),
        ({**_CARRIED, "links": {"/dev/shm/sem.a": "/dev/shm/sem.a"}}, "links: not a link_remap.N beside"),
        ({**_CARRIED, "links": {"/dev/shm/link_remap.3": 7}}, "links: not a link_remap.N beside"),
        (
            {"sockets": [manifest.BoundSocket("run/app.sock", 0, 1, 2, 3)]},
            "sockets, dirs: not a normalised absolute path",
        ),
        ({"dirs": [manifest.MadeDir("/tmp/../etc", 0, 0, 0o755)]}, "sockets, dirs: not a normalised absolute path"),
        ({"dirs": [manifest.MadeDir("/", 0, 0, 0o755)]}, "sockets, dirs: not a normalised absolute path"),
        (
            {
                "sockets": [manifest.BoundSocket("/t/p/s", -1, 1, 2, 3)],
                "dirs": [manifest.MadeDir("/t/p", -1, 0, 0o700)],
            },
            "sockets, dirs: not a user, group or mode",
        ),
        (
            {
                "sockets": [manifest.BoundSocket("/t/p/s", 1000, 1, 2, 3)],
                "dirs": [manifest.MadeDir("/etc", 1000, 0, 0o700)],
            },
            "dirs: one is not on the way to a socket of its owner or a carried file",
        ),
        (
            {
                "sockets": [manifest.BoundSocket("/t/p/s", 1000, 1, 2, 3)],
                "dirs": [manifest.MadeDir("/t/p", 0, 0, 0o700)],
            },
            "dirs: one is not on the way to a socket of its owner or a carried file",
        ),
    ],
)
def test_a_self_consistent_but_malformed_manifest_is_refused(
    tmp_path: Path, changes: dict[str, Any], field: str
) -> None:
    _manifest(**changes).write(tmp_path)  # (written with a valid checksum over the bad field)
    with pytest.raises(SnapshotInvalid, match=f"is corrupt: (field )?.*{re.escape(field)}"):
        manifest.load(tmp_path)


def test_where_unix_sockets_are_bound_reads_back(tmp_path: Path) -> None:
    dirs = [manifest.MadeDir("/tmp/pymp-x", 1000, 1000, 0o700)]
    bound = [manifest.BoundSocket("/tmp/pymp-x/listener-y", 1000, 1, 2, 3)]
    _manifest(sockets=bound, dirs=dirs).write(tmp_path)
    m = manifest.load(tmp_path)
    assert m.sockets == bound and m.dirs == dirs


def test_a_directory_on_the_way_to_a_carried_file_reads_back_and_must_be_its_owner_s(tmp_path: Path) -> None:
    """A directory of a carried file's owner reads back; the restore refuses one the manifest
    gives to another user (the file's owner is in the carried archive), or one on the way to a
    file the archive lacks, before writing anything."""
    snap = tmp_path / "snap"
    where = tmp_path / "node" / "scratch"
    images = snap / manifest.IMAGES_DIR
    images.mkdir(parents=True)
    log = where / "u" / "job" / "log"
    with tarfile.open(images / manifest.CARRIED_NAME, "w") as tar:
        info = tarfile.TarInfo(str(log).lstrip("/"))
        info.size = 3
        info.uid = 1000
        info.gid = 1000
        tar.addfile(info, io.BytesIO(b"log"))
    dirs = [manifest.MadeDir(str(where / "u"), 1000, 1000, 0o700), manifest.MadeDir(str(log.parent), 2000, 2000, 0o700)]
    m = _manifest(carried=[str(log)], files=manifest.checksum_files(snap), dirs=dirs)
    m.write(snap)
    assert manifest.load(snap).dirs == dirs
    created: list[Path] = []
    with pytest.raises(SnapshotInvalid, match=f"gives a directory on the way to {log} to another user"):
        putback._write_carried(snap, m, created)
    m.dirs = dirs[:1]
    m.carried.append(str(where / "v" / "not-archived"))  # (no file of the archive vouches for its directory's owner)
    with pytest.raises(SnapshotInvalid, match=f"carried files lack {where}/v/not-archived"):
        putback._write_carried(snap, m, created)
    assert created == [] and not (tmp_path / "node").exists()


def test_a_boolean_is_not_an_integer(tmp_path: Path) -> None:
    _manifest(root_pid=True).write(tmp_path)
    with pytest.raises(SnapshotInvalid, match="manifest.root_pid"):
        manifest.load(tmp_path)


def test_verify_refuses_truncated_extra_and_altered_images(snap: Path) -> None:
    m = manifest.load(snap)
    pages = snap / "images" / "pages-1.img"
    original = pages.read_bytes()
    pages.write_bytes(original[:-1])
    with pytest.raises(SnapshotInvalid, match="pages-1.img has 2999 bytes, the manifest says 3000"):
        manifest.verify(snap, m)
    pages.write_bytes(bytes([original[0] ^ 1]) + original[1:])
    with pytest.raises(SnapshotInvalid, match="is damaged: images/pages-1.img does not match its checksum"):
        manifest.verify(snap, m)
    pages.write_bytes(original)
    (snap / "images" / "planted.img").write_bytes(b"x")
    with pytest.raises(SnapshotInvalid, match="holds image files the manifest does not list: images/planted.img"):
        manifest.verify(snap, m)
    (snap / "images" / "planted.img").unlink()
    (snap / "images" / "core-100.img").unlink()
    with pytest.raises(SnapshotInvalid, match="incomplete: images/core-100.img is missing"):
        manifest.verify(snap, m)


def test_verify_refuses_a_symlink_among_the_images(snap: Path) -> None:
    m = manifest.load(snap)
    (snap / "images" / "core-100.img").unlink()
    (snap / "images" / "core-100.img").symlink_to("/etc/passwd")
    with pytest.raises(SnapshotInvalid, match="is unsafe: images/core-100.img is not a regular file"):
        manifest.verify(snap, m)


def test_verify_refuses_an_unknown_chunk_size(snap: Path) -> None:
    m = manifest.load(snap)
    m.files["images/pages-1.img"]["chunk_size"] = manifest.CHUNK_SIZE // 2
    with pytest.raises(SnapshotInvalid, match="unknown chunk size for images/pages-1.img"):
        manifest.verify(snap, m)


def test_checksums_are_per_chunk(tmp_path: Path) -> None:
    images = tmp_path / manifest.IMAGES_DIR
    images.mkdir()
    size = manifest.CHUNK_SIZE + 5
    (images / "big.img").write_bytes(b"\0" * size)
    files = manifest.checksum_files(tmp_path, workers=2)
    entry = files["images/big.img"]
    assert (entry["size"], entry["chunk_size"], len(entry["digests"])) == (size, manifest.CHUNK_SIZE, 2)
    assert entry["digests"] == [
        blake3.blake3(b"\0" * manifest.CHUNK_SIZE).hexdigest(),
        blake3.blake3(b"\0" * 5).hexdigest(),
    ]
    assert (
        manifest.chunk_digest((images / "big.img", manifest.CHUNK_SIZE, 5), "sha256")
        == hashlib.sha256(b"\0" * 5).hexdigest()
    )


def _as_format_1(data: dict[str, Any], snap: Path) -> None:
    """What tpagent wrote before format 2: SHA-256 chunk digests under "sha256", no "digest"."""
    del data["digest"]
    data["format_version"] = 1
    sha = manifest.checksum_files(snap, digest="sha256")
    for rel, entry in data["files"].items():
        entry["sha256"] = sha[rel]["digests"]
        del entry["digests"]
    _reseal(data)


def _reseal(data: dict[str, Any]) -> None:
    """The manifest's own checksum made again over its edited body."""
    data.pop("manifest_sha256", None)
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    data["manifest_sha256"] = hashlib.sha256(canonical.encode()).hexdigest()


def test_a_format_1_snapshot_is_still_read_and_verified_with_sha256(snap: Path) -> None:
    assert manifest.load(snap).digest == "blake3"
    _rewrite(snap, lambda d: _as_format_1(d, snap))
    m = manifest.load(snap)
    assert m.digest == "sha256" and m.files["images/pages-1.img"]["size"] == 3000
    manifest.verify(snap, m)
    blake = {k: v["digests"] for k, v in manifest.checksum_files(snap).items()}
    manifest.verify(snap, m, blake, "blake3")  # (digests of another algorithm: hashed again, not compared)
    with open(snap / "images" / "pages-1.img", "r+b") as f:
        f.seek(1000)
        f.write(b"\xff" if f.read(1) != b"\xff" else b"\0")
    with pytest.raises(SnapshotInvalid, match="images/pages-1.img does not match its checksum"):
        manifest.verify(snap, m)


def test_an_unknown_digest_is_refused(snap: Path) -> None:
    _rewrite(snap, lambda d: (d.update(digest="md5"), _reseal(d)))
    with pytest.raises(SnapshotInvalid, match="field digest is missing or malformed"):
        manifest.load(snap)
