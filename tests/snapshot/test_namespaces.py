"""Namespaces a tree has that `tpagent launch` did not make, as `unshare` or a container's runtime
makes them (a review found each one killed by its dump and never restored): a mount namespace of
its own is rebuilt as a launched workload's is; a user namespace, or a process of the tree with a
namespace apart from its root's, is refused before anything is frozen, and so is a working
directory since removed (CRIU would make it again by its name, which the restore's check cannot
tell from one planted there)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import needs_criu
from host.signals import kill_tree
from support.helpers import Workload, assert_continuous, assert_one_sentence_error, tpagent, wait_until

pytestmark = needs_criu

#: The workload's standard files opened again inside the namespace (those opened outside it, CRIU
#: cannot find the mount of: refused on their own).
INSIDE = ("sh", "-c", 'cd / && exec "$@" </dev/null >/dev/null 2>&1', "x")


def test_a_process_in_a_mount_namespace_of_its_own_comes_back_in_one(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """(Dumped without its mounts declared the node's, every restore failed: CRIU segfaulted.)"""
    w = start(mib=16, wrap=("unshare", "--mount", "--propagation", "private", *INSIDE))
    snap = tmp_path / "snap"
    proc = tpagent("dump", str(w.pid), "--out", str(snap))
    assert proc.returncode == 0, proc.stderr
    w.reap()
    stopped_at = w.ticks()[-1][0]
    proc = tpagent("restore", str(snap))
    assert proc.returncode == 0, proc.stderr
    wait_until(lambda: w.ticks()[-1][0] >= stopped_at + 5, "the copy to tick on")
    assert_continuous(w.ticks())
    w.verify_state()


def _refused(w: Workload, tmp_path: Path, *said: str) -> None:
    """The dump of ``w`` is refused, saying ``said``, before anything is frozen: it ticks on."""
    proc = tpagent("dump", str(w.pid), "--out", str(tmp_path / "snap"))
    assert_one_sentence_error(proc, *said)
    assert "othing was done" in proc.stderr and not (tmp_path / "snap").exists(), proc.stderr
    n = w.ticks()[-1][0]
    wait_until(lambda: w.ticks()[-1][0] > n + 5, "the workload to tick on, never frozen")
    assert_continuous(w.ticks())


def test_a_user_namespace_is_refused_before_the_freeze(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    w = start(mib=16, wrap=("unshare", "--user", "--map-root-user", *INSIDE))
    _refused(w, tmp_path, f"PID {w.pid} runs in a user namespace of its own")


@pytest.mark.parametrize(("flag", "kind"), [("--net", "network"), ("--mount", "mount"), ("--uts", "UTS")])
def test_a_child_with_a_namespace_apart_from_its_roots_is_refused_before_the_freeze(  # type: ignore[no-untyped-def]
    start, tmp_path: Path, flag: str, kind: str
) -> None:
    """(A child in a network or mount namespace of its own was dumped, and CRIU could never restore it:
    "Can't restore sub-task in NS"; a UTS one CRIU refused in a page of its errors.)"""
    child = f'unshare {flag} sh -c \'cd / && exec "$@" </dev/null >/dev/null 2>&1\' x "$@" & wait'
    w = start(mib=16, wrap=("sh", "-c", child, "x"))
    try:
        _refused(w, tmp_path, f"has a {kind} namespace of its own, apart from its tree's root's (PID {w.pid})")
    finally:
        kill_tree(w.pid)  # (the workload is the shell's child: it would outlive the shell)


def test_a_removed_working_directory_is_refused_before_the_freeze(start, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """(Dumped, its restore made the directory again and the restore's own check killed the copy:
    no restore ever worked.)"""
    gone = tmp_path / "gone"
    w = start(mib=16, wrap=("sh", "-c", 'mkdir "$0" && cd "$0" && rmdir "$0" && exec "$@"', str(gone)))
    _refused(w, tmp_path, f"PID {w.pid}'s working directory was removed ({gone} (deleted))")
