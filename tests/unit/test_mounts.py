"""Which mounts of a workload's namespace a migration's dump leaves out (host.mounts), from
/proc texts and paths: those the target lacks that the tree holds nothing in."""

from __future__ import annotations

from pathlib import Path

from host import mounts

MOUNTINFO = rb"""22 1 254:0 / / rw,relatime - ext4 /dev/vda rw
40 22 0:40 / /proc rw - proc proc rw
61 22 0:52 / /var/lib/docker/overlay2/abc/merged rw - overlay overlay rw,lowerdir=x
62 61 0:53 / /var/lib/docker/overlay2/abc/merged/dev rw - tmpfs tmpfs rw
63 22 0:54 / /mnt/my\040data rw - nfs4 srv:/data rw
64 22 0:55 / /run/user/1000 rw - tmpfs tmpfs rw
65 22 0:55 / /run/user/1000 rw - tmpfs tmpfs rw
"""


def test_the_mount_points_are_read_with_the_kernels_escapes_undone_each_once() -> None:
    assert mounts.points_of(MOUNTINFO) == [
        "/proc",
        "/var/lib/docker/overlay2/abc/merged",
        "/var/lib/docker/overlay2/abc/merged/dev",
        "/mnt/my data",
        "/run/user/1000",
    ]  # (the root is not one: CRIU rebuilds the namespace on the node's own)


def test_a_missing_mount_the_tree_holds_nothing_in_is_left_out_with_what_lies_beneath() -> None:
    mounted = mounts.points_of(MOUNTINFO)
    missing = ["/var/lib/docker/overlay2/abc/merged", "/var/lib/docker/overlay2/abc/merged/dev", "/run/user/1000"]
    held = ["/", "/home/u/train.py", "/run/user/1000/socket", "/var/lib/docker/overlay2/abcd/x"]
    skip, stuck, said = mounts.for_node(mounted, missing, held, [], "B")
    assert skip == ["/var/lib/docker/overlay2/abc/merged", "/var/lib/docker/overlay2/abc/merged/dev"]
    assert said.startswith("the copy goes without 2 mount(s) of the process's namespace that B lacks"), said
    # the session's directory holds a path of the tree's (not a file it carries): it stays, and is said
    assert stuck == [
        "the process holds /run/user/1000/socket in the mount at /run/user/1000, which B lacks: its copy could not "
        "find it there"
    ]


def test_a_missing_mount_holding_only_files_the_dump_carries_is_kept() -> None:
    """A carried file is put back, its directories made, before CRIU binds the mount point."""
    mounted = mounts.points_of(MOUNTINFO)
    skip, stuck, said = mounts.for_node(
        mounted, ["/mnt/my data"], ["/mnt/my data/ckpt.tmp"], ["/mnt/my data/ckpt.tmp"], "B"
    )
    assert (skip, stuck, said) == ([], [], "")


def test_a_target_cannot_name_a_mount_the_tree_does_not_have() -> None:
    mounted = mounts.points_of(MOUNTINFO)
    assert mounts.left_out(mounted, ["/etc", "/"], []) == []


def test_a_mount_the_tree_uses_keeps_the_mounts_above_it() -> None:
    """A skipped mount's children are skipped with it; one the tree uses keeps its parents."""
    mounted = ["/a", "/a/b", "/a/b/c"]
    assert mounts.left_out(mounted, mounted, ["/a/b/c/f"]) == []
    assert mounts.left_out(mounted, mounted, ["/a/f"]) == ["/a/b", "/a/b/c"]
    assert mounts.left_out(mounted, ["/a/b/c"], ["/a/f"]) == ["/a/b/c"]


def test_absent_paths_and_odd_names(tmp_path: Path) -> None:
    (tmp_path / "here").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "nowhere")  # (a name that exists: CRIU finds it)
    paths = [str(tmp_path / "here"), str(tmp_path / "gone"), str(tmp_path / "link"), "relative", "/" + "x" * 5000]
    assert mounts.absent(paths) == [str(tmp_path / "gone")]
    odd = ["/a\nb", "/a\udcffb"]
    _, _, said = mounts.for_node(odd, odd, [], [], "B")
    assert "\n" not in said and "/a\\nb" in said and "/a\\udcffb" in said, said
