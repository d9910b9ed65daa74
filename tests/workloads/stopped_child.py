"""Test workload: a parent and a child that both tick, one of which a test stops (SIGSTOP).

    python stopped_child.py LOG

The child writes ``child N`` and the parent ``tick N`` to LOG every 20 ms (N counts up by one);
a child stopped writes nothing until it is continued.  The child ends with its parent.
"""

import os
import sys
import time


def tick(log: str, key: str, alive: int) -> None:
    with open(log, "a", buffering=1) as out:
        n = 0
        while os.getppid() == alive or alive == 0:
            out.write(f"{key} {n}\n")
            n += 1
            time.sleep(0.02)


if __name__ == "__main__":
    parent = os.getpid()
    if os.fork() == 0:
        tick(sys.argv[1], "child", parent)
        os._exit(0)
    tick(sys.argv[1], "tick", 0)
