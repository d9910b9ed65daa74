"""A rank's output, read for its stand-in (relayed to the launcher's log): through the
descriptor its namespace's init holds, never a path, and only when that is a regular file (a
pipe or a terminal is not read: reading would take the bytes from whoever they were for)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from support.helpers import wait_until
from tpagent.jobs.rankentry import open_output
from tpagent.migration.api import Refused


def test_the_file_the_process_writes_is_read_even_once_its_path_names_another(tmp_path: Path) -> None:
    log = tmp_path / "rank.log"
    with open(log, "wb") as out:
        child = subprocess.Popen(["sh", "-c", "echo first; sleep 30 & wait"], stdout=out)  # (its "workload": sleep)
    try:
        wait_until(lambda: psutil.Process(child.pid).children(), "the child to start its own", 10)
        fd = open_output(child.pid, 1)
        try:
            deadline = time.monotonic() + 10
            while os.fstat(fd).st_size < 6 and time.monotonic() < deadline:
                time.sleep(0.01)
            log.unlink()
            log.symlink_to("/etc/passwd")  # (planted where the log was: not what is read)
            assert os.pread(fd, 100, 0) == b"first\n"
        finally:
            os.close(fd)
    finally:
        for p in psutil.Process(child.pid).children():
            p.kill()
        child.kill()
        child.wait()


def test_a_pipe_is_not_read(tmp_path: Path) -> None:
    child = subprocess.Popen(["sleep", "30"], stdout=subprocess.PIPE)
    try:
        with pytest.raises(Refused, match="is not a file"):
            open_output(child.pid, 1)
    finally:
        child.kill()
        child.wait()
        assert child.stdout is not None
        child.stdout.close()
