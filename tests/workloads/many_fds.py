"""Test workload: holds many descriptors, or one numbered high, as a job that raised its own
limit on open files does (torch users are told to).

    python many_fds.py LOG COUNT     # COUNT descriptors of /dev/null
    python many_fds.py LOG @NUMBER   # one, numbered NUMBER

It raises its soft limit on open files to the hard one, opens them, then every 20 ms writes
``tick N fds M`` to LOG (M: the descriptors it holds, counted in /proc/self/fd).
"""

import os
import resource
import sys
import time


def main() -> None:
    log, what = sys.argv[1], sys.argv[2]
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if what.startswith("@"):
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, int(what[1:]))
        os.close(null)
    else:
        for _ in range(int(what)):
            os.open(os.devnull, os.O_RDONLY)
    with open(log, "a", buffering=1) as out:
        n = 0
        while True:
            out.write(f"tick {n} fds {len(os.listdir('/proc/self/fd'))}\n")
            n += 1
            time.sleep(0.02)


if __name__ == "__main__":
    main()
