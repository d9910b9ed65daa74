"""Says who it runs as (real and effective IDs, groups, directory) every 0.25 s, N times, then
exits with status 3.  argv: N."""

import os
import sys
import time

for i in range(int(sys.argv[1])):
    print(
        f"tick {i} uid {os.getuid()} euid {os.geteuid()} gid {os.getgid()} groups {os.getgroups()} cwd {os.getcwd()}",
        flush=True,
    )
    time.sleep(0.25)
sys.exit(3)
