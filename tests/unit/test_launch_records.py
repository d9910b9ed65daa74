"""A launch record names one process by when it started in clock ticks since boot, which no
step of the wall clock shifts (tpagent.workload.launch)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tpagent.workload import launch


def test_a_record_still_names_its_process_after_the_wall_clock_stepped(tmp_path: Path) -> None:
    records = tmp_path / "launched"
    launch.register(os.getpid(), records=records)
    path = records / f"{os.getpid()}.json"
    written = json.loads(path.read_text())
    path.write_text(json.dumps({**written, "create_time": written["create_time"] + 1.0}))  # (as psutil reads it now)
    assert launch.launched(os.getpid(), records) is not None
    path.write_text(json.dumps({**written, "start": written["start"] + 1}))  # (another process, started later)
    assert launch.launched(os.getpid(), records) is None
    old = {k: v for k, v in written.items() if k != "start"}  # (an earlier tpagent's: by its wall-clock start)
    path.write_text(json.dumps(old))
    assert launch.launched(os.getpid(), records) is not None
    path.write_text(json.dumps({**old, "create_time": old["create_time"] + 1.0}))  # (its clock read a second on)
    assert launch.launched(os.getpid(), records) is not None
    path.write_text(json.dumps({**old, "create_time": old["create_time"] + 5.0}))  # (another process)
    assert launch.launched(os.getpid(), records) is None
