"""The agent's owned threads (tpagent/common/threads.py): what `serve` waits for at shutdown, and
what it only asks to stop."""

from __future__ import annotations

import threading
import time

from tpagent.common.threads import Threads


def test_shutdown_waits_for_migrations_up_to_its_deadline_and_a_second_signal_cuts_it() -> None:
    threads = Threads()
    release = threading.Event()
    threads.spawn("migration", "migrate-1", release.wait)
    threads.spawn("waiter", "resolve-1", lambda: threads.sleep(600))
    assert threads.running() == ["migrate-1", "resolve-1"]
    t0 = time.monotonic()
    assert threads.join(0.3, "migration") == ["migrate-1"]  # still running at the deadline
    assert 0.3 <= time.monotonic() - t0 < 5
    forced = threading.Event()
    forced.set()
    t0 = time.monotonic()
    assert threads.join(60, "migration", give_up=forced) == ["migrate-1"]  # (a second signal)
    assert time.monotonic() - t0 < 5
    release.set()
    assert threads.join(5, "migration") == []
    assert threads.running() == ["resolve-1"]  # a waiter goes on until the agent stops ...
    threads.stopping.set()
    assert threads.join(5) == []  # ... then returns at once


def test_a_thread_that_fails_is_logged_and_forgotten() -> None:
    threads = Threads()

    def boom() -> None:
        raise RuntimeError("a bug")

    threads.spawn("waiter", "boom", boom)
    assert threads.join(5) == []


def test_shutdown_ends_every_wait_on_a_peer_at_once_even_in_a_running_migration() -> None:
    threads = Threads()
    assert threads.sleep(0.05) is False  # (nothing asked: it waits its time)
    threads.spawn("migration", "migrate-1", lambda: threads.sleep(600))  # (a source asking a silent target)
    threads.spawn("waiter", "resolve-1", lambda: threads.sleep(600))
    threads.draining.set()  # SIGTERM: the grace for the migrations' own work begins
    assert threads.join(5) == []  # neither waited for its peer any longer
