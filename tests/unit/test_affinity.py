"""The CPUs a thread is bound to, noted at a dump and bound again at a restore (snapshot.affinity)."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from snapshot import affinity


def test_the_kernels_cpu_lists_are_read_and_anything_else_refused() -> None:
    assert affinity.parse("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert affinity.parse("5") == {5}
    for bad in ("", "3-1", "0,,1", "a", "1-", "0 1", "99999999", "70000"):
        with pytest.raises(ValueError):
            affinity.parse(bad)


def test_a_list_naming_cpus_over_and_over_is_each_cpu_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A manifest's binding (anyone's snapshot: `inspect`, `restore`) naming 0-65535 thousands of
    times was read range by range, each CPU added each time: hours for a manifest of 1 MiB."""
    assert affinity.parse("5,1-2,2-6,0-1") == {0, 1, 2, 3, 4, 5, 6}
    added: list[int] = []
    real = set.update

    class Counted(set[int]):
        def update(self, *more: object) -> None:
            for m in more:
                added.extend(m)  # type: ignore[call-overload]
            real(self, *more)  # type: ignore[arg-type]

    monkeypatch.setattr(affinity, "set", Counted, raising=False)
    assert affinity.parse(",".join(["0-65535"] * 20)) == set(range(65536))
    assert len(added) == 65536


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to bind a thread to")
def test_a_bound_thread_is_noted_and_bound_again_and_cpus_the_node_lacks_leave_it_as_it_is(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A thread bound to fewer CPUs than it may use is noted (the others are not); binding it
    again gives it its CPUs; a binding to CPUs this node does not have leaves it as it is and
    says so."""
    cpus = sorted(os.sched_getaffinity(0))
    ready, done = threading.Event(), threading.Event()
    tid: list[int] = []

    def bound_thread() -> None:
        tid.append(threading.get_native_id())
        os.sched_setaffinity(0, {cpus[0]})
        ready.set()
        done.wait(10)

    t = threading.Thread(target=bound_thread)
    t.start()
    try:
        ready.wait(10)
        noted = affinity.bound([os.getpid()])
        assert [(b.pid, b.tid, affinity.parse(b.cpus)) for b in noted] == [(os.getpid(), tid[0], {cpus[0]})]
        os.sched_setaffinity(tid[0], set(cpus))  # (as CRIU brings it back: on every CPU)
        affinity.rebind(noted, {os.getpid(): os.getpid()})
        assert os.sched_getaffinity(tid[0]) == {cpus[0]}
        with caplog.at_level(logging.WARNING, logger="snapshot.affinity"):
            affinity.rebind([affinity.Binding(os.getpid(), tid[0], "65000")], {os.getpid(): os.getpid()})
        assert os.sched_getaffinity(tid[0]) == {cpus[0]}
        assert "none of which this node has" in caplog.text
    finally:
        done.set()
        t.join()
