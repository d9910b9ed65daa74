"""Test workload: works in a directory of its own and reads a file it mapped there.

    python cwd_mapped.py LOG DIR

It changes to DIR, maps DIR/data.bin (privately, read only) and closes it, then every 20 ms
writes ``tick N byte B`` to LOG (B: the mapped file's first byte) and appends a line to
``progress.txt`` in its working directory, opened anew each time (by a relative name, as a
script's own logs are).  A restore that gave it another DIR or another data.bin shows in B, and
in where its progress lines go.
"""

import mmap
import os
import sys
import time


def main() -> None:
    log, where = sys.argv[1], sys.argv[2]
    os.chdir(where)
    with open("data.bin", "rb") as f:
        data = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    with open(log, "a", buffering=1) as out:
        n = 0
        while True:
            out.write(f"tick {n} byte {data[0]}\n")
            with open("progress.txt", "a") as progress:
                progress.write(f"step {n}\n")
            n += 1
            time.sleep(0.02)


if __name__ == "__main__":
    main()
