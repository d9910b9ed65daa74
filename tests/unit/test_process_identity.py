"""A process is named over time by its start in clock ticks since boot and the boot's id
(host.proc.started), never by psutil's create_time: that adds the kernel's boot time in whole
seconds, read anew at each call, which a slewed or stepped clock moves by a second or more
between two readings of one and the same process (CI once saw a store server's record forgotten
so, the server left running)."""

from __future__ import annotations

import os

import psutil
import pytest
from psutil import _pslinux

from host import proc


@pytest.fixture
def clock_stepped(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on the kernel's boot time reads one second later, as after a step of the clock."""
    then = _pslinux.boot_time()
    monkeypatch.setattr(_pslinux, "boot_time", lambda: then + 1.0)


def test_a_process_is_still_itself_after_the_clock_stepped(monkeypatch: pytest.MonkeyPatch) -> None:
    me = proc.started(os.getpid())
    wall = psutil.Process(os.getpid()).create_time()
    then = _pslinux.boot_time()
    monkeypatch.setattr(_pslinux, "boot_time", lambda: then + 1.0)
    assert psutil.Process(os.getpid()).create_time() != wall  # (what psutil says moved ...)
    assert proc.is_started(os.getpid(), me)  # (... who the process is did not)


def test_another_start_or_another_boot_is_another_process() -> None:
    ticks, _, boot = proc.started(os.getpid()).partition("@")
    assert boot == proc.boot_id() and int(ticks) == proc.start_ticks(os.getpid())
    assert not proc.is_started(os.getpid(), f"{int(ticks) + 1}@{boot}")
    assert not proc.is_started(os.getpid(), f"{ticks}@an-earlier-boot")
    assert not proc.is_started(2**22 + 1, f"{ticks}@{boot}")  # (no such PID)


def test_an_older_tpagents_wall_clock_start_is_read_within_a_second_and_a_half(clock_stepped: None) -> None:
    wall = psutil.Process(os.getpid()).create_time() - 1.0  # (written before the step)
    assert proc.is_started(os.getpid(), wall) and proc.is_started(os.getpid(), repr(wall + 0.5))
    assert not proc.is_started(os.getpid(), wall - 5.0)


@pytest.mark.parametrize("token", [None, True, "", "x@y", "@", [1], "nan"])
def test_what_names_no_start_names_no_process(token: object) -> None:
    assert not proc.is_started(os.getpid(), token)
